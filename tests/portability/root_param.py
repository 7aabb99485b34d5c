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
