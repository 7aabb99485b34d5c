"""A weight a module's own code reads as a tensor in a matrix product (a bank of experts in
``einsum``, ``self.w1[e]`` in a loop) stays whole where no style splits what is not a call of
a module: the plan says so with the op and line, instead of replicating it silently. A bank
beside its router is such a call (one expert op). A position table or class token added to
activations is not such a weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardplan


class EinsumExperts(nn.Module):
    """A dense mixture of experts on raw ``[E, D, F]`` parameters (GShard-style einsums)."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w_in))
        return torch.einsum("bteh,ehd,bte->btd", h, self.w_out, gates)


class TokenModel(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))  # a position table added to the tokens
        self.moe = EinsumExperts(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(x + self.moe(x))


def test_a_bank_beside_its_router_in_the_modules_own_code_is_split_inside_every_expert() -> None:
    """GShard-style einsums on raw banks with the router a Linear child: once said replicated,
    now one expert op split inside every expert (``tests/test_router_banks.py`` runs such
    banks on gloo), the router whole with its gradient summed; the position table is not a
    weight any style splits, and no warning says otherwise."""
    with torch.device("meta"):
        model = TokenModel()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)
    rule = next(r for r in plan.rules if r.module == "moe")
    assert (rule.style, rule.partial_grads) == ("moe_tp_experts", ["router.weight"]), rule
    assert not [w for w in plan.warnings if "no style splits" in w], plan.warnings
    assert not [w for w in plan.warnings if w.startswith("TokenModel.pos")], plan.warnings


class SharedEinsumExperts(EinsumExperts):
    """The same bank beside a shared expert: more than a router inside, so it is traced
    through and its banks read as tensors."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.shared = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared(x)


def test_a_bank_read_in_the_modules_own_code_beside_other_weights_is_said_replicated() -> None:
    with torch.device("meta"):
        model = TokenModel()
        model.moe = SharedEinsumExperts()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)
    said = [w for w in plan.warnings if "in its module's own code, which no style splits; replicated" in w]
    assert [w.split(":")[0] for w in said] == ["moe.w_in", "moe.w_out"], plan.warnings
    assert "weight [4, 32, 64] not sharded: read as a tensor by `einsum` (tests/test_own_weights.py:" in said[0]
