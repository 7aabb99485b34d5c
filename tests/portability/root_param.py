"""A model whose root owns a parameter itself (its rule is ``module: ''``)."""

import torch
from torch import nn


class RootOwnsAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x * self.scale)))


def build() -> nn.Module:
    return RootOwnsAParameter()


def six_heads() -> nn.Module:
    """A small Llama whose 6 heads tp=4 does not divide: its attention runs whole."""
    from shardplan.models import LlamaConfig, Transformer

    return Transformer(LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=6, vocab_size=512, multiple_of=32,
                                   max_seq_len=64))


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MixedStack(nn.Module):
    """Two kinds of block in one stack, interleaved: 0-1 and 4 narrow, 2-3 wide."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim, 64 if i in (2, 3) else 32) for i in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def mixed_stack() -> nn.Module:
    return MixedStack()


class GroupedExperts(nn.Module):
    """torchtitan's expert bank layout: w1 and w3 [E, I, H], w2 [E, H, I] (every token
    visits every expert here, weighted by a softmax router, so it traces on meta)."""

    def __init__(self, experts: int = 4, dim: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, inner, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, inner) * inner**-0.5)
        self.w3 = nn.Parameter(torch.randn(experts, inner, dim) * dim**-0.5)

    def forward(self, x, scores):
        h = torch.nn.functional.silu(torch.einsum("th,eih->eti", x, self.w1)) * torch.einsum("th,eih->eti", x, self.w3)
        return torch.einsum("eti,ehi,te->th", h, self.w2, scores)


class TinyMoE(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.router, self.experts = nn.LayerNorm(dim), nn.Linear(dim, 4), GroupedExperts(dim=dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x).reshape(b * s, d)
        return x + self.experts(h, self.router(h).softmax(-1)).reshape(b, s, d)


def tiny_moe() -> nn.Module:
    return TinyMoE()
