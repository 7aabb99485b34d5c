"""Explain's re-solves: one module on request, one block per merged rule on an unfolded
export graph, and a count bound on models whose blocks do not fold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardplan
import shardplan.api as api
from shardplan.decide import explain


def _stack(num_layers: int) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(num_layers))
            self.head = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with torch.device("meta"):
        return Stack()


X = (torch.empty(2, 8, 32, device="meta"),)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = explain.solve
    monkeypatch.setattr(explain, "solve", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_an_unfolded_export_graph_explains_one_block_per_merged_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    per_depth = {}
    for num_layers in (2, 6):
        calls.clear()
        # unfolded (torch.export folds repeated blocks too, unless told not to)
        plan = shardplan.plan_model(_stack(num_layers), {"tp": 2}, example_inputs=X, front_end="export",
                                    fold_repeated=False)
        per_depth[num_layers] = len(calls)
    assert per_depth[2] == per_depth[6] > 0
    # the same decisions as explaining every block and keeping the first of each merged rule
    monkeypatch.setattr(api, "_explained", lambda *a, **k: None)
    calls.clear()
    every = shardplan.plan_model(_stack(6), {"tp": 2}, example_inputs=X, front_end="export", fold_repeated=False)
    assert len(calls) > 3 * per_depth[6]
    assert every.to_json() == plan.to_json()


def test_a_module_name_prices_only_the_rule_that_covers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    full = shardplan.plan_model(_stack(3), {"tp": 2}, example_inputs=X)
    calls = _counting(monkeypatch)
    one = shardplan.plan_model(_stack(3), {"tp": 2}, example_inputs=X, explain="layers.1.up")
    assert [d.module for d in one.decisions] == ["layers.*.up"]
    assert one.explain("layers.1.up") == full.explain("layers.1.up")
    assert len(calls) == len(full.explain("layers.1.up").alternatives)
    assert one.rules == [r.model_copy(update={"why": r.why if r.module == "layers.*.up" else ""}) for r in full.rules]


def test_explain_stops_at_a_count_of_re_solves_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardplan.decide import cost
    from shardplan.decide.solve import SolveContext, solve

    model = _stack(4)
    graph = api._graph(model, X, None, {"fold_repeated": False})
    hw = cost.get_hardware("h100-nvlink")
    ctx = SolveContext(tp=2, hardware=hw, link=cost.axis_links(hw, {"tp": 2})["tp"])
    solution = solve(graph, ctx)
    unbounded = explain.explain_decisions(graph, solution, ctx)
    num_alternatives = sum(len(d.alternatives) for d in unbounded)
    calls = _counting(monkeypatch)
    bound = num_alternatives // 2
    cut = explain.explain_decisions(graph, solution, ctx, max_resolves=bound)
    assert len(calls) <= bound
    assert [d.module for d in cut] == [d.module for d in unbounded]
    priced = [d for d in cut if all(a.reason != explain._unpriced(bound) for a in d.alternatives)]
    assert cut[:len(priced)] == unbounded[:len(priced)] and 0 < len(priced) < len(cut)
    for d in cut[len(priced):]:  # past the cut: every alternative named, none priced
        assert [a.style for a in d.alternatives] == [a.style for a in unbounded[cut.index(d)].alternatives]
        assert all(a.step_time_s is None and "shardplan explain MODULE" in a.reason for a in d.alternatives)
    assert cut == explain.explain_decisions(graph, solution, ctx, max_resolves=bound)

