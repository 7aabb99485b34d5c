"""Dispatch: rows to the ranks that own their experts and back, by all-to-all.

Contract
--------
``send(rows, counts, group)`` sends ``counts[j, e]`` rows (in that order) to rank j's expert
e: the counts first (``all_to_all_single``, the one host sync), then the rows
(``all_to_all_single_autograd``, differentiable: its backward is the reverse exchange).
``exchange`` is the rows' exchange alone (the way back), ``by_expert`` the row order that
groups what arrived by expert, ``ScaleGrad`` an identity whose backward scales the gradient.
Both expert-parallel styles use them: :mod:`.experts_ep` (3-D banks) and
:mod:`.experts_listed` (experts as a module list).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

__all__ = ["ScaleGrad", "by_expert", "exchange", "send"]


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def exchange(rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> torch.Tensor:
    moved = all_to_all_single_autograd(rows.contiguous(), out_sizes, in_sizes, group)
    return torch.ops._c10d_functional.wait_tensor(moved)


def send(rows: torch.Tensor, counts: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[list, list]]:
    """``counts[j, e]`` rows (in that order) to rank j's expert e: the counts exchanged first
    (the one host sync), then the rows. Returns the rows received, ``received[j, e]`` (from
    rank j for this rank's expert e) and the sizes of the way back (sent, received)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send_sizes, recv_sizes = counts.sum(1).tolist(), received.sum(1).tolist()
    return exchange(rows, recv_sizes, send_sizes, group), received, (send_sizes, recv_sizes)


def by_expert(received: torch.Tensor) -> torch.Tensor:
    """Row order that groups rows arriving as ``received[j, e]`` rows from rank j for expert e
    (ranks outer) by expert (experts outer, ranks inner)."""
    sizes = received.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    blocks = torch.arange(sizes.numel(), device=sizes.device).view(received.shape).t().reshape(-1)
    block_sizes, block_starts = sizes[blocks], starts[blocks]
    within = torch.arange(int(sizes.sum()), device=sizes.device) - torch.repeat_interleave(
        torch.cumsum(block_sizes, 0) - block_sizes, block_sizes)
    return torch.repeat_interleave(block_starts, block_sizes) + within
