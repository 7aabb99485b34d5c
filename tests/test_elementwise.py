"""Elementwise modules with scalar parameters (a learnable activation: Apertus's xIELU,
``nn.PReLU()``) run on the MLP's sharded features, their scalars' gradients all-reduced;
one with scalar parameters that is not elementwise (a softmax with a learned temperature)
is not. Plans on meta; numerics and collectives on 2 gloo ranks / the fake group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardplan
from shardplan.tools.simulate import simulate


class LearnedSwish(nn.Module):
    """x * sigmoid(beta * x), beta learned: one scalar, entry by entry."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * torch.sigmoid(self.beta * x)


class TemperedSoftmax(nn.Module):
    """softmax(x / t) over the features: a scalar parameter, but each output reads the whole row."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.softmax(x / self.t, dim=-1)


class MLP(nn.Module):
    def __init__(self, act: nn.Module, dim: int = 32) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), act, nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def _plan(act: nn.Module, tp: int = 2) -> shardplan.Plan:
    with torch.device("meta"):
        model = nn.Sequential(MLP(act), MLP(type(act)() if not isinstance(act, nn.PReLU) else nn.PReLU()))
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 8, 32, device="meta"),), explain=False)


@pytest.mark.parametrize("act", [LearnedSwish, nn.PReLU])
def test_a_scalar_activation_runs_on_the_sharded_features(act) -> None:
    plan = _plan(act())
    styles = plan.module_styles()
    assert [styles[f"0.{n}"] for n in ("up", "act", "down")] == ["colwise", "replicated_with_grad_allreduce", "rowwise"]
    assert plan.rule_for("0.act").input_layouts == "Shard(2)"
    assert not plan.warnings, plan.warnings


def test_scalar_parameters_alone_do_not_make_a_module_elementwise() -> None:
    plan = _plan(TemperedSoftmax())
    rule = plan.rule_for("0.act")
    assert rule.style == "replicate" and rule.input_layouts != "Shard(2)", rule
    assert any("0.up: output all-gathered" in w for w in plan.warnings), plan.warnings


def test_scalar_activation_collectives_are_as_predicted() -> None:
    """Each scalar's gradient is a partial sum over the rank's features: all-reduced once, in
    the bucket that ends backward, not by DTensor inside the activation's backward."""
    model, (x,) = swish_model()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, 32),), explain=False)
    res = simulate(model, plan, (x,))
    assert res.matches, f"counted {dict(res.counted)} != predicted {res.predicted}"


def test_scalar_activation_matches_one_process_on_gloo() -> None:
    from shardplan.tools.verify import verify

    result = verify("tests.test_elementwise:swish_model", nproc=2, timeout_s=300)
    assert result.plan.rule_for("1.act").style == "replicated_with_grad_allreduce"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def swish_model() -> tuple[nn.Module, tuple]:
    """An input projection (so every block's input carries a gradient), then two blocks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), MLP(LearnedSwish()), MLP(LearnedSwish())), (torch.randn(2, 8, 32),)
