"""Packed: the placement of a fused projection whose parts have unequal widths.

Contract
--------
GQA code fuses q, k and v in one Linear and cuts its output unequally (``split([h*hd,
kv*hd, kv*hd], -1)``: litgpt, gpt-fast, OLMo, dbrx; Phi-3's ``qkv[..., :q_pos]``). Split
by heads, rank r must hold rows [q_r; k_r; v_r] (the r-th of tp equal slices of each part),
so ``x W_r^T`` is locally [q_r, k_r, v_r]; the global tensor stays the module's own [Q; K; V].
No upstream placement says that (``_StridedShard(0, split_factor=k)`` cuts k *equal*
parts), so :class:`PackedShard` is ``_StridedShard`` with the parts' relative widths:

* ``PackedShard(dim, parts=(4, 1, 1))`` cuts ``dim`` into parts of 4u, u and u rows
  (u = size / sum(parts)), then each part into tp equal slices; rank r keeps its slice of
  each, in order. Its ``_split_tensor`` is the one thing it overrides, and every DTensor
  path that cuts or stitches a ``_StridedShard`` goes through it: ``full_tensor()`` and a
  redistribute to ``Replicate`` give [Q; K; V], DCP's full state dicts too.
* It compares equal (``==``) to ``_StridedShard(dim, split_factor=len(parts))``, which is what
  DTensor's sharding propagation builds for element-wise results: an in-place update (the
  optimizer's ``mul_``, ``lerp_``, ``addcdiv_``) keeps the parameter's and the moments'
  placement objects (``zeros_like`` copies the spec), so optimizer state keeps the layout.
  Its hash includes the parts, so DTensor's caches (redistribute plans) never hand one
  layout's plan to the other.
* Results DTensor computes afresh (a matmul on the DTensor weight) are labelled plain
  ``_StridedShard``: their local tensors are right, their global view is not. So the style
  (:class:`.packed_colwise.PackedColwise`) runs the projection on local tensors, and the weight's
  gradient comes back through ``to_local``'s backward with the weight's own placement.
* ``distribute_tensor`` rebuilds every ``_StridedShard`` as the base class (losing the
  parts): cut with :func:`distribute` instead, which shardplan's own code (state dicts,
  ``load_checkpoint``, ``materialize``) does.

Only a 1-D (tp) mesh: a placement list with a ``PackedShard`` beside other mesh dims (FSDP
over tp) is refused by :func:`distribute`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from ..plan.validate import packed_parts_problem, part_rows

__all__ = ["PackedShard", "distribute", "check_parts"]


def check_parts(parts: Sequence[int], size: int, tp: int, *, what: str) -> list[int]:
    """The rows of each part; ``ValueError`` (one line) unless tp divides every part (the
    plan check's own words, :func:`~shardplan.plan.validate.packed_parts_problem`)."""
    problem = packed_parts_problem(tuple(parts), size, tp)
    if problem:
        raise ValueError(f"{what}: {problem}")
    return part_rows(tuple(parts), size)


class PackedShard(_StridedShard):
    """``_StridedShard`` of parts with relative widths ``parts`` (see the module doc)."""

    def __init__(self, dim: int, *, parts: Sequence[int]) -> None:
        parts = tuple(int(p) for p in parts)
        if len(parts) < 2 or any(p < 1 for p in parts):
            raise ValueError(f"PackedShard needs two or more parts of width >= 1; got {list(parts)}")
        super().__init__(dim, split_factor=len(parts))
        self.parts = parts

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        rows = part_rows(self.parts, tensor.size(self.dim))
        if rows is None or any(r % num_chunks for r in rows):
            raise ValueError(f"PackedShard(parts={list(self.parts)}): dim {self.dim} of size {tensor.size(self.dim)} "
                             f"does not cut into those parts with each divisible by {num_chunks}")
        second = [Shard._custom_chunk(piece, num_chunks, dim=self.dim)
                  for piece in torch.split(tensor, rows, dim=self.dim)]
        shards = []
        for i in range(num_chunks):
            shard = torch.cat([pieces[i] for pieces in second], dim=self.dim)
            shards.append(shard.contiguous() if contiguous else shard)
        return shards, ([0] * num_chunks if with_padding else [])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedShard):
            return self.dim == other.dim and self.parts == other.parts
        return super().__eq__(other)  # a plain _StridedShard of as many parts: what propagation builds

    def __hash__(self) -> int:
        return hash((self.dim, self.parts))

    def __repr__(self) -> str:
        return f"PackedShard(dim={self.dim}, parts={list(self.parts)})"

    def __str__(self) -> str:
        return f"_P({self.dim}, {list(self.parts)})"


def distribute(tensor: torch.Tensor, mesh: Any, placements: Sequence[Any], *, src_data_rank: int | None = 0) -> DTensor:
    """``distribute_tensor``, keeping a :class:`PackedShard` (which ``distribute_tensor``
    would rebuild as a plain ``_StridedShard``); ``src_data_rank=None`` cuts locally."""
    placements = tuple(placements)
    packed = [p for p in placements if isinstance(p, PackedShard)]
    if not packed:
        return distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)
    if len(placements) != 1:
        raise ValueError(f"a fused projection of unequal parts (placed {placements}) is split on a 1-D tp mesh only; "
                         "shard it over one axis (FSDP over tp does not keep its layout)")
    p = placements[0]
    if p.dim < 0:
        p = PackedShard(p.dim + tensor.ndim, parts=p.parts)
    local = p._shard_tensor(tensor.detach(), mesh, 0, src_data_rank)
    out = DTensor.from_local(local, mesh, (p,), run_check=False, shape=tensor.shape, stride=tensor.stride())
    return out.requires_grad_(tensor.requires_grad) if tensor.requires_grad else out
