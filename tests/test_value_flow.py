"""Forward code that branches on tensor values: the tracer follows the example inputs' values.

Research code and older Hugging Face models test masks (``if not padding_mask.any():``),
size tensors by a count (``.item()``), and route tokens to experts through ``nonzero``.
These models are written here, not taken from a library, so each construct is tested alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardplan
from shardplan.analyze.trace import TraceError, trace_model
from shardplan.plan.model import expand_pattern
from tests.portability.listed_experts import HitMoE
from tests.portability.lm import TokenLM

PAD = 0


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(x)))


class MaskedLM(nn.Module):
    """Branches on the ids: a padding mask only where there is padding, and a table of
    positions as long as the longest unpadded row (``.item()``)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids.eq(PAD)
        mask = None
        if padding.any():
            mask = ~padding[:, None, None, :]
        longest = int((~padding).sum(dim=1).max().item())
        positions = torch.arange(longest, device=ids.device).clamp(max=ids.shape[1] - 1)
        x = self.tok(ids) + self.pos(positions).mean(0)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def moe_lm(vocab: int = 64, dim: int = 32, depth: int = 3, num_experts: int = 4) -> TokenLM:
    # top-1 routing written the common way: a loop over the experts some token picked
    return TokenLM([HitMoE(dim, 64, num_experts) for _ in range(depth)], dim=dim, vocab=vocab)


def _ids(*, padded: bool) -> torch.Tensor:
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[1, 10:] = PAD
    return ids


@pytest.mark.parametrize("padded", [False, True])
def test_a_branch_on_the_ids_is_traced_as_their_values_take_it(padded: bool) -> None:
    with torch.device("meta"):
        model = MaskedLM()
    traced = trace_model(model, (_ids(padded=padded),))
    sdpa = [n for n in traced.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert sdpa and all((n.kwargs.get("attn_mask") is not None) == padded for n in sdpa)
    said = "\n".join(traced.notes)
    assert f"`if padding.any():` traced as the example inputs take it ({padded})" in said
    assert "computed from the example inputs' values" in said and "test_value_flow.py" in said
    arange = next(n for n in traced.graph.nodes if n.target is torch.arange)
    assert arange.meta["val"].shape == (16 if not padded else 16,)


def test_a_branch_on_meta_inputs_says_to_pass_real_ones() -> None:
    with torch.device("meta"):
        model = MaskedLM()
    with pytest.raises(TraceError, match=r"test_value_flow.py:\d+ `if padding.any\(\):`.*pass real example inputs"):
        trace_model(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))


def test_a_value_that_depends_on_meta_weights_cannot_be_computed() -> None:
    class RoutesOnWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if self.gate(x).sum() > 0 else x

    with torch.device("meta"):
        model = RoutesOnWeights()
    with pytest.raises(TraceError, match="gate.weight is on the meta device"):
        trace_model(model, (torch.ones(2, 8),))


def test_the_plan_is_the_same_for_every_run_and_from_the_default_inputs() -> None:
    with torch.device("meta"):
        model = MaskedLM()
    plans = [shardplan.plan_model(model, {"tp": 4}) for _ in range(2)]
    assert plans[0].to_yaml() == plans[1].to_yaml()
    assert any("`if padding.any():` traced as the example inputs take it" in w for w in plans[0].warnings)


def test_experts_chosen_through_nonzero_are_each_split_and_named_by_pattern() -> None:
    """On meta weights nothing says which experts a token picks: every expert is taken as
    hit (nonzero's upper bound), each runs once, and the rules cover every expert of every
    layer, split like a dense MLP."""
    with torch.device("meta"):
        model = moe_lm()
    plan = shardplan.plan_model(model, {"tp": 4})
    assert any("every element taken as nonzero" in w for w in plan.warnings)
    styles = plan.module_styles()
    for layer in range(3):
        for e in range(4):
            assert styles.get(f"layers.{layer}.experts.{e}.w1") == "colwise", styles
            assert styles.get(f"layers.{layer}.experts.{e}.w2") == "rowwise", styles
    repeats = plan.model.repeats
    expert_rules = [r.module for r in plan.rules if ".experts." in r.module]
    assert expert_rules and all("experts.*" in m for m in expert_rules)
    assert len({m for r in expert_rules for m in expand_pattern(r, repeats)}) == 3 * 4 * 3  # w1, w3, w2
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.estimate.param_bytes_per_device <= num_bytes / 4 * 1.01  # every weight split 4 ways


def test_formatting_a_value_of_meta_weights_keeps_tracing() -> None:
    """A log line's f-string of a loss-like scalar has no value on meta weights: it is not an
    error (only code that needs the number, a branch or an index, is)."""
    class Logs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            self.last = f"mean {y.mean()}"
            return y

    with torch.device("meta"):
        model = Logs()
    traced = trace_model(model, (torch.ones(2, 8),))
    assert any(n.op == "call_module" and n.target == "lin" for n in traced.graph.nodes)


class SharedPlusRouted(nn.Module):
    """Llama 4's return: ``out = shared(x); out.add_(routed)``, the caller reading ``out``."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.shared, self.routed = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        out = self.shared(x)
        out.add_(self.routed(x))
        return out * 2


def test_a_value_changed_in_place_is_read_as_changed() -> None:
    """``out.add_(y)`` returns ``out`` changed; fx hands back a new node but the code goes on
    with the proxy it holds, so every later reader read ``out`` as it was before the add."""
    from shardplan.analyze.graph import build_graph

    graph = build_graph(trace_model(SharedPlusRouted(), (torch.randn(2, 4, 32),)))
    add_ = next(op for op in graph.ops if op.target == "add_")
    readers = [graph.ops[c].target for c in graph.consumers.get(add_.output, [])]
    assert readers == ["mul"], readers
    shared = next(op for op in graph.ops if op.target == "shared")
    assert [graph.ops[c].target for c in graph.consumers[shared.output]] == ["add_"]
