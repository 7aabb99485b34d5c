"""A user's MoE layer in one module, its router a Linear child beside raw 3-D expert banks
(``tests/portability/router_banks.py``): split inside every expert (``moe_tp_experts``), the
router whole with its gradient summed, under sequence parallel gathered on entry and
reduce-scattered where it returns; counted collectives equal the prediction, and gloo
ranks match one process."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.analyze.graph import expert_params
from shardplan.plan.model import Plan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import router_banks

ROUTERS = {"loop_moe": ["router.weight"], "loop_moe_square": ["router.weight"], "dense_moe": ["gate.weight", "gate.bias"]}


def _plan(name: str, tp: int, **opts) -> Plan:
    with torch.device("meta"):
        model = getattr(router_banks, name)()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False, **opts)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_a_bank_beside_its_router_is_split_inside_every_expert(name: str, tp: int) -> None:
    plan = _plan(name, tp)
    rule = next(r for r in plan.rules if r.module == "layers.*.moe")
    assert rule.style == "moe_tp_experts" and rule.partial_grads == ROUTERS[name], rule
    assert not [w for w in plan.warnings if ".moe" in w], plan.warnings
    result = simulate(getattr(router_banks, name)(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("name", ["loop_moe", "dense_moe"])
def test_under_sequence_parallel_the_bank_gathers_and_reduce_scatters_itself(name: str) -> None:
    plan = _plan(name, 2, sequence_parallel=True)
    rule = next(r for r in plan.rules if r.module == "layers.*.moe")
    assert (rule.style, rule.input_layouts, rule.output_layouts) == ("moe_tp_experts", "Shard(1)", "Shard(1)"), rule
    assert plan.module_styles()["layers.1.norm2"] == "sequence_parallel"
    result = simulate(getattr(router_banks, name)(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_square_bank_reads_as_its_code_multiplies_it() -> None:
    """[E, 64, 64] twice reads as F.linear's [E, out, in] or bmm's [E, in, out] by shape:
    ``x @ self.w_up[e]`` is the bmm layout, so up splits on dim 2 (the other reading failed
    the local check and the bank stayed whole)."""
    ep = expert_params(router_banks.LoopMoE(64, hidden=64))
    assert (ep.up, ep.up_dim, ep.down, ep.down_dim) == ("w_up", 2, "w_down", 1)


@pytest.mark.parametrize(("spec", "sequence_parallel"), [
    ("tests.portability.router_banks:loop_moe", None),
    ("tests.portability.router_banks:dense_moe", True),
])
def test_router_banks_match_one_process_on_gloo(spec: str, sequence_parallel) -> None:
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=sequence_parallel)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    rule = next(r for r in result.plan.rules if r.module == "layers.*.moe")
    assert rule.style == "moe_tp_experts", rule
