"""Builders that misbehave, for ``package.module:callable`` model specs.

The CLI cases copy this file into a temporary directory as ``bi_builders.py`` and name
``bi_builders:<callable>``; the API cases import the classes from here.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

NOT_CALLABLE = 42


def raises():
    raise RuntimeError("builder exploded: width 'sixty-four'")


def exits():
    sys.exit(0)


def hard_exit():
    os._exit(0)


def returns_dict():
    return {"layers": [nn.Linear(4, 4)]}


def needs_args(width, depth):
    return nn.Linear(width, depth)


class Empty(nn.Module):
    """No parameters at all: nothing to shard."""

    def forward(self, x):
        return x * 2


class Branchy(nn.Module):
    """Branches on tensor values: the meta tracer cannot follow it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        if (x > 0).any():
            return self.a(x)
        return self.b(x)


class ConvOnly(nn.Module):
    """No Linear or Embedding: example inputs cannot be inferred."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)
