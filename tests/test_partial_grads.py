"""Whole (Replicate) values that need a gradient and meet a computation split tp ways.

A learned temperature a container reads in its forward, times scores split by heads: each
rank's gradient is a sum over its heads only. It stays whole and its gradient is
all-reduced once when backward ends (``partial_grads`` on the container's rule). A gate
computed by a Linear too narrow to split, times a sharded activation, would have the same
partial gradient with nothing to reduce it: the planner refuses that strategy. Both were
silently wrong gradients before (attn.temperature off by 6.4e-3 on 2 gloo ranks)."""

from __future__ import annotations

import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability.scales import GatedLM, ScaledLM, scaled_lm

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def _plan(cls: type) -> shardplan.Plan:
    with torch.device("meta"):
        model = cls()
    return shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS)


def test_temperature_stays_whole_with_a_reduced_gradient() -> None:
    plan = _plan(ScaledLM)
    assert [plan.module_styles()[f"attn.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    rule = plan.rule_for("attn")
    assert rule.param_layouts == {"head_scale": "Shard(1)"} and rule.partial_grads == ["temperature"]
    result = simulate(scaled_lm(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.predicted["backward"]["all_reduce"] == 1
    assert result.counted == {p: {k: n for k, n in c.items() if n} for p, c in result.predicted.items()}


def test_gate_from_a_whole_linear_is_not_broadcast_into_shards() -> None:
    """Whatever the styles, the product of the gate and the up projection is never a
    whole gate times a shard: the plan's placement of that ``mul`` has no ``R`` operand
    beside a sharded output."""
    from shardplan.api import _graph
    from shardplan.decide.strategies import op_strategies

    with torch.device("meta"):
        model = GatedLM()
    graph = _graph(model, TOKENS, None, {})
    (mul,) = [op for op in graph.ops if op.target == "mul"]
    for s in op_strategies(mul, graph, tp=2):
        assert s.output == "R" or "R" not in s.inputs, s


def test_both_match_one_process_on_gloo() -> None:
    for spec in ("tests.portability.scales:scaled_lm", "tests.portability.scales:gated_lm"):
        result = verify(spec, nproc=2, timeout_s=240)
        assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
