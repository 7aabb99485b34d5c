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
