"""Packed outputs: how the code cuts a fused projection's output into parts.

Contract
--------
``packed_into(op, graph)`` is ``k`` when every reader of a Linear's output cuts its last dim
into the same ``k`` equal parts (``chunk``, ``split`` by a width or equal sections, slices
of one part's width, a ``(k, heads, head_dim)`` view); ``unequal_parts(op, graph, tp)`` the
relative widths of unequal ones (GQA's ``split([h * hd, kv * hd, kv * hd])``, Phi-3's slices
that tile the output), when tp divides each; ``slice_partition(graph, value)`` the widths of
slices that tile a value. :mod:`.weights` offers ``packed_colwise`` where one of them
answers; with kv parts of fewer heads than ranks, :mod:`.tails` does.
"""

from __future__ import annotations

import math

from ..analyze.graph import Op, OpGraph
from .placements import narrow_index, slice_range, sliced_part, split_parts, split_widths, view_parts

__all__ = ["packed_into", "unequal_parts", "slice_partition"]


def packed_into(op: Op, graph: OpGraph) -> int | None:
    """k when every consumer cuts the output's last dim into the same k equal parts: a
    fused gate/up or q/k/v projection split by ``chunk``/``split``, sliced part by part, or
    viewed as ``(k, heads, head_dim)``."""
    shape = graph.values[op.output].shape
    last = len(shape) - 1
    users = [graph.ops[c] for c in graph.consumers.get(op.output, [])]
    counts = {_parts_taken(u, graph, shape, last) for u in users}
    return counts.pop() if len(counts) == 1 and None not in counts else None


def slice_partition(graph: OpGraph, value: int) -> tuple[int, ...] | None:
    """The widths of the parts the consumers of ``value`` slice its last dim into, when every
    one takes one contiguous range and together they tile it (Phi-3's ``qkv[..., :q_pos]``,
    ``qkv[..., q_pos:q_pos + kv]``, ``qkv[..., q_pos + kv:]``; ``narrow`` alike)."""
    shape = graph.values[value].shape
    ranges = set()
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        index = user.node.args[1] if user.target == "getitem" and len(user.node.args) > 1 else (
            narrow_index(user.node.args, len(shape)) if user.target == "narrow" else None)
        found = slice_range(index, shape) if index is not None and shape else None
        if found is None or found[0] != len(shape) - 1:
            return None
        ranges.add(found[1:])
    bounds = sorted(ranges)
    if len(bounds) < 2 or bounds[0][0] != 0 or bounds[-1][1] != shape[-1] or any(
            a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return tuple(b - a for a, b in bounds)


def unequal_parts(op: Op, graph: OpGraph, tp: int) -> list[int] | None:
    """The relative widths of unequal parts, when every consumer cuts the output's last dim
    by the same ``split`` of sections (GQA: ``split([h * hd, kv * hd, kv * hd], -1)``), or
    slices it into ranges that tile it (:func:`slice_partition`), and tp divides each part;
    ``[4, 1, 1]`` for 8 query heads beside 2 kv heads."""
    shape = graph.values[op.output].shape
    last = len(shape) - 1
    found = set()
    for c in graph.consumers.get(op.output, []):
        user = graph.ops[c]
        args = user.node.args
        dim = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
        widths = split_widths(user, shape[last]) if isinstance(dim, int) and dim % (last + 1) == last else None
        found.add(widths)
    widths = found.pop() if len(found) == 1 else None
    widths = widths or slice_partition(graph, op.output)
    if widths is None or len(set(widths)) == 1 or any(w % tp for w in widths):
        return None
    unit = math.gcd(*widths)
    return [w // unit for w in widths]


def _parts_taken(user: Op, graph: OpGraph, shape: tuple[int, ...], last: int) -> int | None:
    if user.target in ("chunk", "split", "tensor_split"):
        args = user.node.args
        dim = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
        return split_parts(user, shape[last]) if isinstance(dim, int) and dim % (last + 1) == last else None
    index = user.node.args[1] if user.target == "getitem" and len(user.node.args) > 1 else (
        narrow_index(user.node.args, len(shape)) if user.target == "narrow" else None)
    if index is not None:
        # the parts' width is that of each slice: every slice must take one whole part
        found = sliced_part(index, shape)
        return found[1] if found and found[0] == last else None
    if user.target in ("view", "reshape") and user.output is not None:
        found = view_parts(shape, graph.values[user.output].shape)
        return found[1] if found and found[0] == last else None
    return None
