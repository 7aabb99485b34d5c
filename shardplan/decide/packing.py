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

__all__ = ["packed_into", "unequal_parts", "slice_partition", "cut_value", "passes_through", "packed_chains"]

# elementwise ops of one tensor that keep its shape, met between a fused projection and its
# cut: OLMo's and DBRX's ``qkv.clamp_(min=-clip, max=clip)``, a scale, a cast, dropout
_PASS_THROUGH = frozenset({"clamp", "clamp_", "clip", "clip_", "mul", "mul_", "truediv", "div", "div_", "neg",
                           "to", "float", "half", "bfloat16", "contiguous", "dropout", "type"})


def passes_through(op: Op, graph: OpGraph) -> bool:
    """``op`` is elementwise on one tensor (scalars aside) and keeps its shape."""
    return (op.kind == "function" and op.target in _PASS_THROUGH and len(op.inputs) == 1 and op.output is not None
            and graph.values[op.output].shape == graph.values[op.inputs[0]].shape)


def _in_place_through(op: Op, graph: OpGraph) -> bool:
    """An in-place elementwise op whose result nothing reads (``qkv.clamp_(...)``): the code
    goes on reading the tensor it wrote."""
    return passes_through(op, graph) and op.target.endswith("_") and not graph.consumers.get(op.output)


def cut_value(graph: OpGraph, value: int) -> tuple[int, list[Op]]:
    """The value the code cuts a projection's output through: ``value``, or what a chain of
    elementwise ops (:func:`passes_through`) makes of it, with those ops. An in-place one
    (``qkv.clamp_(...)``, the cut then reading ``qkv``) is passed over."""
    chain: list[Op] = []
    while True:
        users = [graph.ops[c] for c in graph.consumers.get(value, [])]
        in_place = [u for u in users if _in_place_through(u, graph)]
        rest = [u for u in users if u not in in_place]
        chain += in_place
        if len(rest) != 1 or not passes_through(rest[0], graph) or len(chain) > 8:
            return value, chain
        chain.append(rest[0])
        value = rest[0].output


def packed_into(op: Op, graph: OpGraph) -> int | None:
    """k when every consumer cuts the output's last dim into the same k equal parts: a
    fused gate/up or q/k/v projection split by ``chunk``/``split``, sliced part by part, or
    viewed as ``(k, heads, head_dim)``, elementwise ops before the cut passed through."""
    value, chain = cut_value(graph, op.output)
    shape = graph.values[value].shape
    last = len(shape) - 1
    users = [graph.ops[c] for c in graph.consumers.get(value, []) if graph.ops[c] not in chain]
    counts = {_parts_taken(u, graph, shape, last) for u in users}
    return counts.pop() if len(counts) == 1 and None not in counts else None


def packed_chains(graph: OpGraph, tp: int) -> dict[int, int]:
    """Op index -> part count, for the elementwise ops between a packed projection and its
    cut (each runs on the packed layout as it is, block by block)."""
    key = ("packed chains", tp)
    if key not in graph.strategy_cache:
        found: dict[int, int] = {}
        for op in graph.ops:
            if op.kind != "module" or op.module_kind not in ("linear", "conv1d") or op.output is None:
                continue
            _, chain = cut_value(graph, op.output)
            if chain:
                parts = packed_into(op, graph) or unequal_parts(op, graph, tp)
                n = parts if isinstance(parts, int) else len(parts or [])
                found.update((c.index, n) for c in chain if n > 1)
        graph.strategy_cache[key] = found
    return graph.strategy_cache[key]


def slice_partition(graph: OpGraph, value: int) -> tuple[int, ...] | None:
    """The widths of the parts the consumers of ``value`` slice its last dim into, when every
    one takes one contiguous range and together they tile it (Phi-3's ``qkv[..., :q_pos]``,
    ``qkv[..., q_pos:q_pos + kv]``, ``qkv[..., q_pos + kv:]``; ``narrow`` alike)."""
    shape = graph.values[value].shape
    ranges = set()
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        if _in_place_through(user, graph):
            continue  # ``qkv.clamp_(...)`` before the slices
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
    value, chain = cut_value(graph, op.output)
    shape = graph.values[value].shape
    last = len(shape) - 1
    found = set()
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        if user in chain:
            continue
        args = user.node.args
        dim = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
        widths = split_widths(user, shape[last]) if isinstance(dim, int) and dim % (last + 1) == last else None
        found.add(widths)
    widths = found.pop() if len(found) == 1 else None
    widths = widths or slice_partition(graph, value)
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
