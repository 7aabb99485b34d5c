"""Placements: the strategy record every op and weight style is priced by, and its spelling.

Contract
--------
A placement is ``"R"`` (Replicate), ``"P"`` (Partial: each rank holds a summand),
``"S{d}"`` (Shard(d)) or ``"S{d}p{k}"`` (a packed output: ``k`` blocks along ``d``, each
sharded, as a fused gate/up projection's output). A :class:`Strategy` names the placements
of an op's inputs and output, the collectives its forward and backward issue, and its
per-device bytes and flops. Nothing here knows any op: :mod:`.strategies` (plain ops) and
:mod:`.weights` (weight styles) build the strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..analyze.graph import Op

__all__ = ["Comm", "Strategy", "shard_dim", "placement_str", "packed", "chunk_count"]

Comm = tuple[str, int]  # (collective kind, logical bytes)


@dataclass(frozen=True)
class Strategy:
    name: str  # style name for weight modules ("colwise", ...); "" for plain ops
    inputs: tuple[str, ...]
    output: str | None
    fwd: tuple[Comm, ...] = ()
    bwd: tuple[Comm, ...] = ()
    entry: tuple[str | None, ...] = ()
    param_bytes: float = 0.0  # per device
    weight_bytes: float = 0.0  # per device, 2-D+ weights only: what "shard everything" counts
    flops: float = 0.0  # per device, forward + backward
    mem_bytes: float = 0.0  # bytes touched per device (memory-bound ops)
    act_bytes: float = 0.0  # output bytes kept per device
    layouts: dict[str, Any] = field(default_factory=dict, compare=False)


def shard_dim(p: str) -> int | None:
    return int(p[1:].split("p")[0]) if p.startswith("S") else None


def placement_str(p: str) -> str:
    """Upstream spelling: R -> Replicate(), S2 -> Shard(2), P -> Partial()."""
    d = shard_dim(p)
    return f"Shard({d})" if d is not None else {"R": "Replicate()", "P": "Partial()"}[p]


def packed(dim: int, parts: int) -> str:
    """Placement of a packed_colwise output: ``parts`` blocks along ``dim``, each sharded."""
    return f"S{dim}p{parts}"


def chunk_count(op: Op) -> int | None:
    """``k`` of ``x.chunk(k, dim)``, or None for any other op."""
    if op.target != "chunk":
        return None
    k = op.node.kwargs.get("chunks", op.node.args[1] if len(op.node.args) > 1 else None)
    return k if isinstance(k, int) and k > 1 else None
