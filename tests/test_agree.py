"""Ranks that disagree fail at once, on every rank, with a message naming the ranks (2 gloo ranks)."""

from __future__ import annotations

import shardplan
from shardplan.models import build_preset
from shardplan.tools.launch import run_on_gloo
from tests import _agree_workers as workers


def test_a_rank_given_another_plan_makes_every_rank_raise_at_once():
    plan = shardplan.plan_model(build_preset("mlp"), {"tp": 2}, explain=False)
    results = run_on_gloo(workers.different_plans, world_size=2, args=(plan.to_yaml(),), timeout_s=90)
    for kind, message, seconds in results:
        assert kind == "RankDisagreement"
        assert "ranks [1] hold another plan than rank 0" in message
        assert "rule 'layers.1: rowwise' vs 'layers.1: replicate'" in message
        assert seconds < 10


def test_a_planner_failing_on_one_rank_fails_every_rank_with_its_message():
    results = run_on_gloo(workers.planner_fails_on_one_rank, world_size=2, timeout_s=90)
    kinds = [kind for kind, _, _ in results]
    assert kinds == ["RankDisagreement", "RankDisagreement"]
    for _, message, seconds in results:
        assert message.startswith("planning failed on 1 of 2 ranks (rank 1: PlanningError: memory budget 1000 B per device")
        assert seconds < 30  # rank 0 plans in full before it hears of rank 1's failure


def test_the_plan_is_the_same_with_or_without_a_process_group():
    """The local check runs on meta tensors of the caller's mesh under a process group, so a
    hard-coded head count is found (and made local) there too and every rank gets the plan
    the CLI writes."""
    import torch

    from tests.portability.heads import HardCodedHeads

    with torch.device("meta"):
        model = torch.nn.Sequential(HardCodedHeads(), torch.nn.LayerNorm(32))
    alone = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, 32, device="meta"),)).to_yaml()
    assert "attributes:" in alone and "heads: 2" in alone
    ranks = run_on_gloo(workers.plan_under_the_process_group, world_size=2, timeout_s=90)
    assert ranks == [alone, alone]


def test_torchtitan_grouped_experts_split_inside_every_expert_match_one_process():
    """w1, w3 [E, I, H] split on I like the up projection, w2 [E, H, I] on I like the down one."""
    import torch

    from tests.portability.root_param import tiny_moe

    plan = shardplan.plan_model(tiny_moe(), {"tp": 2}, example_inputs=(torch.zeros(2, 8, 16),), explain=False)
    assert plan.module_styles()["experts"] == "moe_tp_experts"
    for diffs in run_on_gloo(workers.moe_numerics, world_size=2, args=(plan.to_yaml(),), timeout_s=90):
        assert diffs.pop("sharded") == 1.0
        assert max(diffs.values()) < 1e-5, diffs
