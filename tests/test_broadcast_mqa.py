"""One kv head broadcast to every query head by the matmuls themselves (Falcon-style MQA,
``q @ k.transpose(-1, -2)`` with k ``[b, 1, s, hd]``): q split by heads, k and v whole on
every rank with their gradients summed (``Rp``), as with an ``expand``. Before, the whole
attention ran gathered."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability import kv_heads


@pytest.mark.parametrize("tp", [2, 3, 6])
def test_a_key_broadcast_by_the_matmul_keeps_the_queries_split_by_heads(tp: int) -> None:
    with torch.device("meta"):
        model = kv_heads.broadcast_mqa()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)
    styles = plan.module_styles()
    assert [styles[f"layers.0.attn.{n}"] for n in ("query", "key", "value", "dense")] == [
        "colwise", "colwise_gather_output", "colwise_gather_output", "rowwise"], plan.warnings


def test_a_key_broadcast_by_the_matmul_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.kv_heads:broadcast_mqa", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
