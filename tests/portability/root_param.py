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
