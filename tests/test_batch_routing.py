"""Routing along the tokens (Switch's capacity, expert choice) is said where a data axis
(dp, ep) makes each rank route its own rows; top-k over each token's own scores is not."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.interop import hf
from tests.portability import batch_routing

MIXING = {"switch_lm": ("cumsum", "torch.cumsum(mask, dim=0)"), "expert_choice_lm": ("topk", "torch.topk(scores.t()")}


def _line(code: str) -> int:
    source = open(batch_routing.__file__).read().splitlines()
    return next(i for i, text in enumerate(source, 1) if code in text)


def _plan(name: str, mesh: dict[str, int]) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(batch_routing, name)()
    return shardplan.plan_model(model, mesh, example_inputs=(torch.zeros(4, 16, dtype=torch.long, device="meta"),),
                                explain=False)


def _mixing(plan: shardplan.Plan) -> list[str]:
    return [w for w in plan.warnings if "its routing runs along the tokens" in w]


@pytest.mark.parametrize("mesh", [{"ep": 2}, {"dp": 2, "tp": 2}])
@pytest.mark.parametrize("name", sorted(MIXING))
def test_routing_along_the_tokens_is_named_on_a_data_axis(name: str, mesh: dict[str, int]) -> None:
    op, code = MIXING[name]
    line = _line(code)
    [warning] = _mixing(_plan(name, mesh))
    axis = next(a for a in mesh if a != "tp")
    assert warning.startswith(f"moe: its routing runs along the tokens: `{op}` (tests/portability/batch_routing.py:{line} ")
    assert f"each rank of {axis}=2 routes its own rows" in warning


@pytest.mark.parametrize("name", sorted(MIXING) + ["top_k_lm"])
def test_tensor_parallel_alone_and_top_k_routing_are_not_warned(name: str) -> None:
    assert not _mixing(_plan(name, {"tp": 2}))
    if name == "top_k_lm":
        assert not _mixing(_plan(name, {"ep": 2})) and not _mixing(_plan(name, {"dp": 2, "tp": 2}))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_library_routing_over_each_tokens_scores_is_not_warned(kind: str) -> None:
    """Mixtral's top-k, Qwen3-MoE's, DeepSeek-V3's group-limited top-k: per token."""
    model, inputs, kwargs = hf.build_hf_model(kind, tiny=True, device="meta")
    plan = shardplan.plan_model(model, {"ep": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    assert not _mixing(plan), plan.warnings


@pytest.mark.parametrize("name", sorted(MIXING) + ["top_k_lm"])
def test_the_warning_tells_the_truth_the_halves_route_otherwise(name: str) -> None:
    """What the warning claims, on the model itself: the batch routed in two halves (two data
    ranks) gives another result than the whole batch exactly where the routing mixes tokens."""
    model = getattr(batch_routing, name)()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens)
        halves = torch.cat([model(tokens[:2]), model(tokens[2:])])
    assert torch.allclose(whole, halves, atol=1e-6) is (name not in MIXING)
