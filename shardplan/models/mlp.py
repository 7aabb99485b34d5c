"""A plain multi-layer perceptron: the smallest model the planner is tested on.

Contract:

* ``MLP(dims)`` holds ``layers`` = ``nn.ModuleList`` of biased ``nn.Linear``
  (``layers.0`` maps dims[0] -> dims[1], and so on); GELU is applied functionally
  between consecutive layers and not after the last, so the FQNs are exactly
  ``layers.<i>`` with no activation modules in between.
* ``forward(x: FloatTensor[batch, dims[0]]) -> FloatTensor[batch, dims[-1]]``.
  Alternating up/down projections (e.g. 128 -> 512 -> 128) are the textbook
  column-then-row parallel pairs.
* No control flow at all, so any ``torch.fx`` tracer and ``torch.export`` work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, dims: Sequence[int] = (64, 256, 64), approximate: str = "none") -> None:
        super().__init__()
        if len(dims) < 2:
            raise ValueError(f"MLP needs at least two dims, got {tuple(dims)}")
        self.dims = tuple(int(d) for d in dims)
        self.approximate = approximate
        self.layers = nn.ModuleList(
            nn.Linear(d_in, d_out, bias=True) for d_in, d_out in zip(self.dims, self.dims[1:])
        )

    def init_weights(self, seed: int | None = None) -> None:
        """Reinitialise in place (e.g. after ``to_empty``); same seed, same weights
        as a model constructed on CPU after ``torch.manual_seed(seed)``."""
        if seed is not None:
            torch.manual_seed(seed)
        for layer in self.layers:
            layer.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.gelu(x, approximate=self.approximate)
        return x
