"""Mixture-of-experts layers as a user writes them in one module: the router a Linear child,
the experts raw 3-D ``nn.Parameter`` banks its own code indexes (issue 31: raw banks in a
container were left whole). Two ways of running them: a loop over experts with
``torch.where`` and ``index_add_`` into ``zeros_like`` (bmm layout, ``x @ self.w_up[e]``),
and every token through every expert weighted by its dense scores (``einsum``, the F.linear
layout ``[E, out, in]``). Square banks (hidden == intermediate) read either way by shape."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import TokenLM
from tests.portability.natural import Attention


class LoopMoE(nn.Module):
    def __init__(self, dim: int, experts: int = 4, hidden: int | None = None, top_k: int = 2) -> None:
        super().__init__()
        hidden = hidden or 2 * dim
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        x = x.reshape(-1, D)
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w_up.shape[0]):
            rows, slot = torch.where(chosen == e)
            h = F.gelu(x[rows] @ self.w_up[e]) @ self.w_down[e]
            out.index_add_(0, rows, h * weights[rows, slot, None])
        return out.reshape(B, T, D)


class DenseMoE(nn.Module):
    def __init__(self, dim: int, experts: int = 4, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 2 * dim
        self.gate = nn.Linear(dim, experts)
        self.fc1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.fc2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)  # [b, s, e]
        h = F.silu(torch.einsum("bsd,ehd->bseh", x, self.fc1))
        y = torch.einsum("bseh,edh->bsed", h, self.fc2)
        return (y * scores.unsqueeze(-1)).sum(-2)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


def _lm(make, *, dim: int = 64, heads: int = 4, layers: int = 2, vocab: int = 256) -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([MoEBlock(dim, heads, make(dim)) for _ in range(layers)], dim=dim, vocab=vocab)


def loop_moe() -> TokenLM:
    return _lm(LoopMoE)


def loop_moe_square() -> TokenLM:
    return _lm(lambda d: LoopMoE(d, hidden=d))


def dense_moe() -> TokenLM:
    return _lm(DenseMoE)
