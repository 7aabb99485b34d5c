"""Mixture of experts as research code writes it: an ``nn.ModuleList`` of SwiGLU experts, a
router Linear, top-k by ``topk``, and each expert's tokens picked with ``torch.where`` and
summed back with ``index_add_``. The rows each expert sees depend on the router's values, so
the meta fx tracer cannot follow it and torch.export gives those sizes as data-dependent
symbols."""

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedMoE(nn.Module):
    def __init__(self, dim: int, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, 2 * dim) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view(x.shape)


class MoELM(nn.Module):
    def __init__(self, dim: int = 64, vocab: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(RoutedMoE(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def moe_lm() -> MoELM:
    torch.manual_seed(0)
    return MoELM()
