"""A norm over heads in groups (RetNet: ``nn.GroupNorm(heads, dim)`` on the heads' outputs):
each group is one head's channels, so a rank holding whole heads normalizes them alone. The
attention is split by heads and the norm is told its local group count; with the global
count it would run on groups of the wrong width, with no shape to say so (gloo proves it)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import retention

_TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tp", [2, 4])
def test_retention_is_split_by_heads_with_its_group_norm_made_local(tp: int) -> None:
    plan = shardplan.plan_model(retention.retnet(), {"tp": tp}, example_inputs=(_TOKENS,), explain=False)
    styles = plan.module_styles()
    for p in "qkvg":
        assert styles[f"layers.0.retention.{p}_proj"] == "colwise", styles
    assert styles["layers.0.retention.out_proj"] == "rowwise" and not plan.warnings, plan.warnings
    (norm,) = [a for a in plan.attributes if a.module.endswith("group_norm")]
    assert norm.values == {"num_groups": 4 // tp, "num_channels": 64 // tp}, norm
    counted = simulate(retention.retnet(), plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_groups_tp_does_not_divide_keep_the_norm_whole() -> None:
    """4 heads, 4 groups at tp=8 would leave half a group per rank: the heads stay whole and
    the warning says why."""
    model = retention.RetNet(dim=128, heads=4)
    plan = shardplan.plan_model(model, {"tp": 8}, example_inputs=(_TOKENS,), explain=False)
    assert not [a for a in plan.attributes if a.module.endswith("group_norm")]
    assert plan.module_styles()["layers.0.retention.q_proj"] == "colwise_gather_output"
    assert any("makes 4 groups (heads)" in w and "tp=8 does not divide" in w for w in plan.warnings), plan.warnings


def test_retention_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.retention:retnet", nproc=2, timeout_s=300)
    assert result.plan.module_styles()["layers.0.retention.q_proj"] == "colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
