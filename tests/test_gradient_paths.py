"""Where no gradient flows, no backward collective is predicted: code the model runs under its
own ``torch.no_grad()`` (HRM's recurrent steps but the last, a research loop that refines
its state without gradients), and modules whose output only picks top-k indices (DeepSeek
V3.2's and GLM-5's indexer). Before, the prediction counted their backward all-reduces and
disagreed with what ``CommDebugMode`` counted (HRM 769 predicted, 481 counted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardplan
from shardplan.analyze.graph import build_graph
from shardplan.analyze.trace import trace_model
from shardplan.tools.simulate import simulate


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Refiner(nn.Module):
    """A state refined ``steps`` times by one shared block, all but the last step without
    gradients (one-step gradient, as HRM and deep-equilibrium models train)."""

    def __init__(self, vocab: int = 64, dim: int = 32, steps: int = 3) -> None:
        super().__init__()
        self.steps = steps
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        z = torch.zeros_like(x)
        with torch.no_grad():
            for _ in range(self.steps - 1):
                z = self.block(z + x)
        z = self.block(z + x)
        return self.head(z)


_IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_ops_under_the_models_no_grad_need_no_gradient() -> None:
    graph = build_graph(trace_model(Refiner(), (_IDS,)))
    calls = [op for op in graph.ops if op.kind == "module" and op.target == "block.up"]
    assert len(calls) == 3
    assert [op.output in graph.requires_grad for op in calls] == [False, False, True]


def test_planning_under_the_callers_no_grad_still_prices_training() -> None:
    with torch.no_grad():
        graph = build_graph(trace_model(Refiner(steps=1), (_IDS,)))
    assert any(op.output in graph.requires_grad for op in graph.ops if op.kind == "module")


@pytest.mark.parametrize("tp", [2, 4])
def test_counted_collectives_equal_the_prediction(tp: int) -> None:
    model = Refiner()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(_IDS,), explain=False)
    counted = simulate(model, plan, (_IDS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
    assert plan.estimate.collectives["backward"].all_reduce < plan.estimate.collectives["forward"].all_reduce


@pytest.mark.parametrize("model_type", ["deepseek_v32", "hrm_text"])
def test_hf_types_with_gradient_free_paths_count_what_they_predict(model_type: str, capsys) -> None:
    from shardplan.cli import main

    assert main(["simulate", f"hf-tiny:{model_type}", "--mesh", "tp=2"]) == 0
    assert "DIFFERS" not in capsys.readouterr().out
