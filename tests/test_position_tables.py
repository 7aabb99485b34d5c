"""A learned per-head table that the attention's own code indexes (Swin's relative-position
bias, ``table[index.view(-1)]`` of a ``[positions, heads]`` parameter beside its qkv and proj
Linears): split on its heads dim with the heads, so attention stays split by heads. Before,
indexing a table by a tensor had no sharded rule, and the whole attention ran on every rank."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import window_attention

_TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _plan(tp: int, *, dim: int = 96, heads: int = 4, **opts) -> shardplan.Plan:
    with torch.device("meta"):
        model = window_attention.WindowLM(dim=dim, heads=heads)
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False, **opts)


def _attention(plan: shardplan.Plan) -> dict[str, tuple[str, dict]]:
    return {r.module: (r.style, r.param_layouts) for r in plan.rules if ".attn" in r.module}


@pytest.mark.quick
@pytest.mark.parametrize("tp, heads", [(2, 4), (4, 4), (3, 6)])
def test_the_table_is_split_with_the_heads(tp: int, heads: int) -> None:
    plan = _plan(tp, heads=heads)
    assert _attention(plan) == {
        "blocks.*.attn": ("replicate", {"relative_position_bias_table": "Shard(1)"}),
        "blocks.*.attn.qkv": ("packed_colwise", {}), "blocks.*.attn.proj": ("rowwise", {})}, plan.warnings
    assert not plan.warnings


@pytest.mark.quick
def test_heads_tp_does_not_divide_keep_the_table_whole() -> None:
    plan = _plan(4, heads=6)
    assert _attention(plan)["blocks.*.attn"] == ("replicate", {})


def test_counted_collectives_equal_the_prediction() -> None:
    for opts in ({}, {"sequence_parallel": True}):
        model = window_attention.WindowLM()  # simulate shards the model it is given
        plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), explain=False, **opts)
        counted = simulate(model, plan, (_TOKENS,))
        assert counted.matches, f"{opts}: counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.window_attention:WindowLM", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert result.plan.module_styles()["blocks.0.attn.qkv"] == "packed_colwise"
