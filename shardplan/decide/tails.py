"""Whole tails: a fused projection whose last part is one head every query head reads.

Contract
--------
Multi-query attention fuses the query heads and its one k and v head in one Linear:
Falcon-7B's ``query_key_value`` (``view(b, s, heads + 2, hd)``, then ``[..., :-2, :]``,
``[..., [-2], :]``, ``[..., [-1], :]``), StarCoder's ``c_attn``
(``split((embed, hd, hd), -1)``), gpt-fast with ``n_local_heads=1``. Split by heads, rank r
needs ``[q_r, k, v]``: its query heads and the whole kv head (Megatron's and vLLM's MQA).
:func:`tail_width` finds where the code cuts a value into a leading part and a tail, at the
value or after views that keep the cut dim (``unsqueeze``, ``view(b, s, heads + 2, hd)``);
the placement is ``S{d}w{n}`` (:mod:`.placements`). :func:`tail_strategies` carries it
through those views and cuts: the leading part comes out ``Shard(d)``, every piece of the
tail ``Rp`` (whole, its gradient each rank's query heads' share). :func:`tailed_colwise` is
the Linear's strategy: the weight packed ``[a, n]`` (each part split tp ways, so no rank
holds more than 1/tp of it), the tail of the output all-gathered over tp (its backward a
reduce-scatter, which sums the shares). Nothing here is offered unless such a cut exists.
"""

from __future__ import annotations

import math

from ..analyze.graph import Op, OpGraph
from .placements import VIEW_OPS, Strategy, index_items, split_widths, whole_tail

__all__ = ["tail_width", "tail_strategies", "tailed_colwise", "tail_owners"]


def tail_width(graph: OpGraph, value: int, dim: int, tp: int) -> int | None:
    """``n`` when every reader of ``value`` cuts ``dim`` (size s) into ``[0, s - n)`` and
    pieces of ``[s - n, s)``, directly or after views keeping the dim, tp dividing the lead."""
    key = ("tail_width", value, dim, tp)
    if key not in graph.strategy_cache:
        graph.strategy_cache[key] = _tail_width(graph, value, dim, tp)
    return graph.strategy_cache[key]


def _tail_width(graph: OpGraph, value: int, dim: int, tp: int) -> int | None:
    shape = graph.values[value].shape
    if not shape or not 0 <= dim < len(shape):
        return None
    users = [graph.ops[c] for c in graph.consumers.get(value, [])]
    found: set = set()
    heads: list[int] = []
    tails: list[int] = []
    for user in users:
        if user.target == "getitem" and user.inputs[:1] == [value] and len(user.inputs) == 1:
            piece = _indexed(user.node.args[1], shape, dim)
            if piece is None:
                return None
            (heads if piece[0] == "head" else tails).append(piece[1])
        else:
            found.add(_through(user, graph, shape, dim, tp))
    if heads or tails:
        if len(set(heads)) != 1 or not tails or min(tails) < heads[0]:
            return None
        found.add(shape[dim] - heads[0])
    n = found.pop() if len(found) == 1 else None
    lead = shape[dim] - n if n else 0
    return n if n and lead % tp == 0 and lead >= tp else None


def _through(user: Op, graph: OpGraph, shape: tuple[int, ...], dim: int, tp: int) -> int | None:
    """The tail a reader other than an index cuts: a ``split`` by sections on ``dim``, or
    the tail of a view that keeps ``dim`` (moved, or cut into ``(parts, unit)``)."""
    if user.target == "split" and user.inputs[:1] and len(user.inputs) == 1:
        args = user.node.args
        d = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
        widths = split_widths(user, shape[dim]) if isinstance(d, int) and d % len(shape) == dim else None
        return shape[dim] - widths[0] if widths else None
    if user.target not in VIEW_OPS or user.output is None or len(user.inputs) != 1:
        return None
    out = graph.values[user.output].shape
    mapped = _view_dim(shape, out, dim)
    if mapped is None:
        return None
    d, unit = mapped
    n = tail_width(graph, user.output, d, tp)
    return n * unit if n else None


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> tuple[int, int] | None:
    """Where a view puts ``dim``: ``(d, 1)`` when it keeps it whole (an ``unsqueeze`` before
    it), ``(d, unit)`` when it cuts the last dim into ``(parts, unit)``."""
    lead = [n for n in src[:dim] if n != 1]
    if src[dim + 1:] and any(n != 1 for n in src[dim + 1:]):
        return None
    for d in range(len(dst)):
        if [n for n in dst[:d] if n != 1] != lead:
            continue
        if dst[d] == src[dim] and all(n == 1 for n in dst[d + 1:]):
            return d, 1
        rest = math.prod(dst[d + 1:])
        if d + 1 < len(dst) and dst[d] * rest == src[dim] and rest > 1 and dst[d] > 1:
            return d, rest
    return None


def _indexed(index, shape: tuple[int, ...], dim: int) -> tuple[str, int] | None:
    """``("head", stop)`` for ``x[..., :stop, ...]`` on ``dim``, ``("tail", first)`` for an
    index that takes positions from ``first`` on (``[-2]``, ``-1``, ``[s - 2:]``), every
    other dim kept whole; None for any other index."""
    items = index_items(index, len(shape))
    if len(items) != len(shape) or any(i is None for i in items):
        return None
    if any(i != slice(None) for d, i in enumerate(items) if d != dim):
        return None
    item, size = items[dim], shape[dim]
    if isinstance(item, slice) and all(isinstance(b, (int, type(None))) for b in (item.start, item.stop, item.step)):
        start, stop, step = item.indices(size)
        if step != 1 or stop <= start:
            return None
        return ("head", stop) if start == 0 and stop < size else ("tail", start)
    picks = item if isinstance(item, list) else [item]
    if picks and all(isinstance(p, int) and not isinstance(p, bool) and -size <= p < size for p in picks):
        return "tail", min(p % size for p in picks)
    return None


def tail_strategies(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """An op's strategies on a whole-tail value: a view carries it, a cut gives the lead
    ``Shard(d)`` and the tail ``Rp``."""
    if not op.inputs or len(op.inputs) != 1:
        return []
    if op.target == "getitem" and isinstance(op.node.args[0].meta.get("val"), (tuple, list)):
        return _tuple_item(op, graph, tp)
    src = graph.values[op.inputs[0]].shape
    out = []
    for d in range(len(src)):
        n = tail_width(graph, op.inputs[0], d, tp)
        if n is None:
            continue
        p = whole_tail(d, n)
        if op.target == "split":
            out.append(Strategy("", (p,), p))  # a tuple: each item takes its piece (:func:`_tuple_item`)
        elif op.target == "getitem":
            piece = _indexed(op.node.args[1], src, d)
            out += [Strategy("", (p,), f"S{d}" if piece[0] == "head" else "Rp")] if piece else []
        elif op.target in VIEW_OPS and (mapped := _view_dim(src, out_shape, d)):
            m = tail_width(graph, op.output, mapped[0], tp)
            if m is not None and m * mapped[1] == n:
                out.append(Strategy("", (p,), whole_tail(mapped[0], m)))
    return out


def _tuple_item(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """Item i of a ``split`` of a whole-tail value: the lead (i = 0) ``Shard(d)``, the rest ``Rp``."""
    split = next((o for o in graph.ops if o.node is op.node.args[0]), None)
    i = op.node.args[1] if len(op.node.args) > 1 else None
    if split is None or split.target != "split" or not isinstance(i, int) or not split.inputs:
        return []
    src = graph.values[split.inputs[0]].shape
    out = []
    for d in range(len(src)):
        n = tail_width(graph, split.inputs[0], d, tp)
        if n is not None:
            out.append(Strategy("", (whole_tail(d, n),), f"S{d}" if i == 0 else "Rp"))
    return out


def tailed_colwise(op: Op, graph: OpGraph, tp: int, *, weight: str, inputs: list[str], common: dict) -> list[Strategy]:
    """``packed_colwise`` with ``whole_parts: 1``: rank r computes ``[q_r, tail_r]`` from
    rows ``[Q_r; T_r]`` and all-gathers the tail over tp, so it holds ``[q_r, k, v]``.
    Backward, each rank's tail gradient is its query heads' share; the gather's
    reduce-scatter sums the shares and keeps the rank's rows, so the weight's gradient is
    complete, and the input's is Partial, as colwise's is."""
    y = graph.values[op.output]
    last = len(y.shape) - 1
    n = tail_width(graph, op.output, last, tp) if y.shape else None
    if n is None or n % tp:
        return []
    size = y.shape[last]
    unit = math.gcd(size - n, n)
    tail_bytes = y.nbytes * n // size
    act = y.nbytes * ((size - n) // tp + n) / size
    layouts = {"weight": f"{weight}p2", "packed": [(size - n) // unit, n // unit], "whole_parts": 1}
    return [Strategy(
        "packed_colwise", (p,), whole_tail(last, n), fwd=(("all_gather", tail_bytes),), bwd=(("reduce_scatter", tail_bytes),),
        entry=(p,), layouts={**layouts, **({"input": p} if p != "R" else {})}, **{**common, "act_bytes": act},
    ) for p in inputs]


def tail_owners(graph: OpGraph, tp: int) -> set[str]:
    """Modules that call a Linear whose output has a whole tail: where the tail's ``Rp``
    pieces meet the split query heads (``Rp`` strategies are offered there)."""
    return {op.target.rpartition(".")[0] for op in graph.ops if op.kind == "module" and op.module_kind in ("linear", "conv1d")
            and op.output is not None and graph.values[op.output].shape
            and tail_width(graph, op.output, len(graph.values[op.output].shape) - 1, tp) is not None}
