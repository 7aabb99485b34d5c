"""The MILP backend's reductions: the reduced program has the same optimum as the full one
for every bound vector a solve can give, and a real placement program shrinks."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.decide.milp import MilpModel


def _program(rng: np.random.Generator, *, num_ops: int = 12, width: int = 3):
    """A placement program as solve.py writes it: one strategy per op (exactly-one rows); each
    strategy reads its input in one of three placements and writes its output in one, and a
    value's producer and consumer agree (one row per placement: two-term where one strategy
    on each side has it, wider or one-sided otherwise); a continuous entry column pays when
    either of two strategies is chosen."""
    rows, lo, hi, n = [], [], [], num_ops * width
    reads, writes = rng.integers(3, size=(num_ops, width)), rng.integers(3, size=(num_ops, width))
    reads[:, 0] = writes[:, 0] = 0  # as replicating every op is always a plan
    for op in range(num_ops):
        rows.append({op * width + i: 1.0 for i in range(width)})
        lo.append(1.0), hi.append(1.0)
    for op in range(1, num_ops):
        for p in range(3):
            row = {op * width + i: 1.0 for i in range(width) if reads[op, i] == p}
            row.update({(op - 1) * width + i: -1.0 for i in range(width) if writes[op - 1, i] == p})
            if row:
                rows.append(row)
                lo.append(0.0), hi.append(0.0)
    entry = n
    for col in (1, width + 1):
        rows.append({entry: 1.0, col: -1.0})
        lo.append(0.0), hi.append(np.inf)
    model = MilpModel.from_rows(rows, lo, hi, num_vars=n + 1, integer=frozenset(range(n)))
    return model, n + 1


def _optimum(model: MilpModel, upper, cost, extra) -> float | None:
    x = model.view(upper).minimize(cost, extra)
    return None if x is None else float(cost @ x)


def _full_optimum(model: MilpModel, upper, cost, extra) -> float | None:
    x = model.view(upper)._run(cost, extra)  # the unreduced program, as HiGHS alone sees it
    return None if x is None else float(cost @ x)


@pytest.mark.parametrize("seed", range(12))
def test_the_reduced_program_has_the_full_programs_optimum_under_any_bounds(seed):
    rng = np.random.default_rng(seed)
    model, n = _program(rng)
    assert model.reduced().model.num_vars < n
    solved = 0
    for trial in range(6):
        upper = np.ones(n)
        upper[rng.choice(n, size=trial * 2, replace=False)] = 0.0  # forced styles exclude columns
        cost = rng.uniform(0.1, 10.0, n)
        extra = ((rng.uniform(0.0, 1.0, n), float(rng.uniform(2.0, 8.0))),) if trial % 2 else ()
        full, reduced = _full_optimum(model, upper, cost, extra), _optimum(model, upper, cost, extra)
        assert (full is None) == (reduced is None), (seed, trial)
        if full is not None:
            solved += 1
            assert reduced == pytest.approx(full, rel=1e-9, abs=1e-9)
    assert solved  # the comparison is not vacuous: at least one bound vector admits a plan


def test_a_solution_is_expanded_to_every_column_and_satisfies_the_full_rows():
    for seed in range(20):
        model, n = _program(np.random.default_rng(seed))
        x = model.view(np.ones(n)).minimize(np.arange(n, dtype=float))
        if x is not None:
            break
    assert x is not None and x.shape == (n,)
    activity = np.zeros(model.num_rows)
    for j in range(n):
        for k in range(model.start[j], model.start[j + 1]):
            activity[model.index[k]] += model.value[k] * x[j]
    assert np.all(activity >= model.lo - 1e-9) and np.all(activity <= model.hi + 1e-9)


def test_a_program_that_only_zero_can_satisfy_is_infeasible_for_every_bound():
    rows = [{0: 1.0, 1: 1.0}, {0: 1.0}, {1: 1.0}]  # exactly one of two, yet each must be zero
    model = MilpModel.from_rows(rows, [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], num_vars=2, integer=frozenset({0, 1}))
    assert model.reduced().infeasible
    assert model.view(np.ones(2)).minimize(np.ones(2)) is None


def test_a_placement_program_shrinks_to_a_fraction_of_its_columns():
    from shardplan.analyze.frontend import op_graph
    from shardplan.analyze.trace import trace_model
    from shardplan.api import infer_example_inputs
    from shardplan.decide import cost
    from shardplan.decide.solve import SolveContext, _matrices
    from shardplan.models import build_preset

    model = build_preset("llama3-debug", device="meta")
    graph = op_graph(model, infer_example_inputs(model, batch_size=2, seq_len=16), None, tracer=trace_model)
    hw = cost.get_hardware("h100-nvlink")
    m = _matrices(graph, SolveContext(tp=2, hardware=hw, link=cost.axis_links(hw, {"tp": 2})["tp"]))
    assert m.model.reduced().model.num_vars * 3 < m.model.num_vars
