"""Attention in the code between or after a stack's blocks (a final attention, timm's
attention pool, a Perceiver): split by heads with the local sizes its code needs, found by
the check of that code. Before, the plan split it and the check only warned ("local shape
check skipped"): the ranks crashed on its ``reshape(B, N, C)``. A root parameter that only
weight modules read (Perceiver's latents) is not summed again after backward."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability import outer_attention

SPLIT = {"blocks_then_attention": ("final_attn", ("to_q", "to_k", "to_v"), "to_out"),
         "pooled_classifier": ("attn_pool", ("q", "kv"), "proj"),
         "perceiver": ("read", ("to_q", "to_k", "to_v"), "to_out")}


def _plan(name: str, tp: int) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(outer_attention, name)()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_attention_outside_the_stack_is_split_by_heads_with_its_local_sizes(name: str, tp: int) -> None:
    plan = _plan(name, tp)
    module, cols, row = SPLIT[name]
    styles = plan.module_styles()
    assert {styles[f"{module}.{c}"] for c in cols} <= {"colwise", "packed_colwise"}, plan.warnings
    assert styles[f"{module}.{row}"] == "rowwise", plan.warnings
    assert not plan.warnings, plan.warnings
    fixed = {a.module for a in plan.attributes} | {v.module for v in plan.local_views}
    assert module in fixed, (plan.attributes, plan.local_views)
    assert all(not r.partial_grads for r in plan.rules), [r for r in plan.rules if r.partial_grads]


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_attention_outside_the_stack_matches_one_process_on_gloo(name: str) -> None:
    result = verify(f"tests.portability.outer_attention:{name}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
