"""A fused q/k/v with an elementwise op between it and its cut (OLMo v1's in-place clamp_,
DBRX's clamp, a scale): still ``packed_colwise``, split by heads. Before, the projection was
gathered (``colwise_gather_output``) and the output projection ``rowwise_split_input``."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability import clipped

SPLIT = {"olmo_clamp": ("att_proj", "attn_out"), "dbrx_clamp": ("Wqkv", "out_proj"), "scaled_chunk": ("qkv", "proj")}


# 6 heads (2 kv heads in OLMo's: tp=3 leaves its k and v whole, as it would without the clamp)
@pytest.mark.parametrize(("name", "tp"), [("olmo_clamp", 2), ("dbrx_clamp", 2), ("dbrx_clamp", 3), ("scaled_chunk", 2),
                                          ("scaled_chunk", 3)])
def test_an_elementwise_op_before_the_cut_keeps_the_fused_projection_packed(name: str, tp: int) -> None:
    with torch.device("meta"):
        model = getattr(clipped, name)()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)
    fused, out = SPLIT[name]
    styles = plan.module_styles()
    assert (styles[f"layers.0.attn.{fused}"], styles[f"layers.0.attn.{out}"]) == ("packed_colwise", "rowwise"), plan.warnings
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("name", ["olmo_clamp", "dbrx_clamp"])
def test_an_elementwise_op_before_the_cut_matches_one_process_on_gloo(name: str) -> None:
    result = verify(f"tests.portability.clipped:{name}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
