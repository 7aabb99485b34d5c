"""Whole tails: a fused projection whose last parts are kv heads too few to split tp ways.

Contract
--------
Multi-query and grouped-query attention fuse the query heads and the k and v heads in one
Linear: Falcon-7B's ``query_key_value`` (``view(b, s, heads + 2, hd)``, then ``[..., :-2, :]``,
``[..., [-2], :]``, ``[..., [-1], :]``), StarCoder's ``c_attn`` (``split((embed, hd, hd), -1)``),
litgpt's per-group rows (``view(B, T, 1, q_per_kv + 2, hs)``, permuted, ``split((q_per_kv, 1,
1), 2)``), gpt-fast's ``split([dim, kv_size, kv_size])``. Split by heads with fewer kv heads
than ranks, rank r needs ``[q_r, k_g, v_g]``: its query heads and the kv head they read,
g = r // (tp / kv), whole (Megatron's and vLLM's answer; with one kv head, every rank the
whole head). :func:`tail_of_value` finds where the code cuts a value into a leading part
and a tail of pieces (k, v), at the value or after views and permutes that keep the cut dim,
and how many kv heads each piece holds (a view ``[.., kv * hd] -> [.., kv, hd]`` of the
piece; one when none). The placement is ``S{d}w{n}`` or ``S{d}w{n}g{kv}``
(:mod:`.placements`); :func:`tail_strategies` carries it through those views and permutes,
and a cut gives the lead ``Shard(d)`` and each piece ``Rp`` (one kv head: whole, its gradient
each rank's query heads' share) or ``S{d}g{kv}`` (grouped, :mod:`.heads`).
:func:`tailed_colwise` is the Linear's strategy: the weight packed ``[a, k, v]`` (each part
split tp ways, so no rank stores more than 1/tp of it), each piece of the output all-gathered
over the ranks of its kv head (its backward a reduce-scatter, which sums the shares).
Nothing here is offered unless such a cut exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..analyze.graph import Op, OpGraph
from .placements import VIEW_OPS, Strategy, group_counts, grouped, index_items, permutation, split_widths, whole_tail

__all__ = ["Tail", "tail_of_value", "tail_strategies", "tailed_colwise", "tail_owners", "grouped_tail_values"]


@dataclass(frozen=True)
class Tail:
    """The last ``sum(pieces)`` entries of a dim, cut into ``pieces`` (k, v), each holding
    ``groups`` kv heads (1: one head, whole on every rank)."""

    pieces: tuple[int, ...]
    groups: int = 1

    @property
    def n(self) -> int:
        return sum(self.pieces)

    def scaled(self, unit: int) -> "Tail":
        return Tail(tuple(p * unit for p in self.pieces), self.groups)

    def placement(self, dim: int) -> str:
        return whole_tail(dim, self.n, self.groups)

    def piece(self, dim: int) -> str:
        return "Rp" if self.groups == 1 else grouped(dim, self.groups)


def tail_of_value(graph: OpGraph, value: int, dim: int, tp: int) -> Tail | None:
    """The tail every reader of ``value`` cuts ``dim`` into, after a lead tp divides."""
    key = ("tail_of_value", value, dim, tp)
    if key not in graph.strategy_cache:
        graph.strategy_cache[key] = _tail_of_value(graph, value, dim, tp)
    return graph.strategy_cache[key]


def _tail_of_value(graph: OpGraph, value: int, dim: int, tp: int) -> Tail | None:
    shape = graph.values[value].shape
    if not shape or not 0 <= dim < len(shape):
        return None
    found: set = set()
    cuts: list[tuple[int, int, int]] = []  # (start, stop, reader) of each index on dim
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        if user.target == "getitem" and user.inputs[:1] == [value] and len(user.inputs) == 1:
            span = _indexed(user.node.args[1], shape, dim)
            if span is None:
                return None
            cuts.append((*span, user.output))
        else:
            found.add(_through(user, graph, shape, dim, tp))
    if cuts:
        found.add(_from_cuts(graph, sorted(cuts), shape[dim], tp))
    tail = found.pop() if len(found) == 1 else None
    lead = shape[dim] - tail.n if tail else 0
    if not tail or lead % tp or lead < tp or tp % tail.groups or _ambiguous(graph, cuts, lead, tail, tp):
        return None
    return tail


def _ambiguous(graph: OpGraph, cuts: list[tuple[int, int, int]], lead: int, tail: Tail, tp: int) -> bool:
    """A piece indexed from the start (``[..., [h], :]``) where a rank's ``[q_r, k, v]`` is
    long enough to hold that index too: unless the code computes it from a size made local,
    it reads another piece there with the right shape, which no check on shapes can tell."""
    local = lead // tp + tail.n // tail.groups
    return any(a >= lead and a < local and not _from_end(graph.ops[graph.values[out].producer], lead + tail.n)
               for a, _, out in cuts)


def _from_end(op: Op, size: int) -> bool:
    """The index of ``op`` (a getitem) is written from the end of the dim (``[-2]``, ``[-2:]``)."""
    items = index_items(op.node.args[1], len(op.node.args[0].meta["val"].shape))
    picks = [i for i in items if i != slice(None)]
    if len(picks) != 1:
        return False
    item = picks[0]
    bound = item.start if isinstance(item, slice) else min(item) if isinstance(item, list) else item
    return isinstance(bound, int) and bound < 0


def _from_cuts(graph: OpGraph, cuts: list[tuple[int, int, int]], size: int, tp: int) -> Tail | None:
    """Indexes that tile ``[0, size)``: the first from 0 is the lead, the rest the pieces."""
    if cuts[0][0] != 0 or cuts[-1][1] != size or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])) or len(cuts) < 2:
        return None
    return _pieces(graph, [(b - a, out) for a, b, out in cuts[1:]], tp)


def _pieces(graph: OpGraph, pieces: list[tuple[int, int | None]], tp: int) -> Tail | None:
    """The pieces' widths and kv heads: the count a view splits each piece's last dim into
    (``[b, s, kv * hd] -> [b, s, kv, hd]``), one when none does. None when a piece is viewed
    into heads tp divides (split by heads as any part is) or that do not divide tp, or the
    pieces disagree."""
    counts = {_viewed_count(graph, out, tp) if out is not None else 1 for _, out in pieces}
    kv = counts.pop() if len(counts) == 1 else None
    return Tail(tuple(w for w, _ in pieces), kv) if kv else None


def _viewed_count(graph: OpGraph, value: int, tp: int) -> int | None:
    """The kv heads a view of ``value``'s last dim makes: 1 with no such view, None for a
    count that is not 1 or a kv group count at this tp."""
    src = graph.values[value].shape if value in graph.values else ()
    i = len(src) - 1
    for c in graph.consumers.get(value, []):
        dst = graph.values[graph.ops[c].output].shape if graph.ops[c].output is not None else ()
        if graph.ops[c].target in VIEW_OPS and src and dst[:i] == src[:i] and len(dst) == i + 2 \
                and dst[i] * dst[i + 1] == src[i]:
            return dst[i] if dst[i] == 1 or dst[i] in group_counts(tp) else None
    return 1


def _through(user: Op, graph: OpGraph, shape: tuple[int, ...], dim: int, tp: int) -> Tail | None:
    """The tail a reader other than an index cuts: a ``split`` by sections on ``dim``, or
    the tail of a view or permute that keeps ``dim`` (moved, or cut into ``(parts, unit)``)."""
    if user.target == "split" and len(user.inputs) == 1:
        args = user.node.args
        d = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
        widths = split_widths(user, shape[dim]) if isinstance(d, int) and d % len(shape) == dim else None
        items = [graph.ops[c] for c in graph.consumers.get(user.output, [])]
        outs = {u.node.args[1] % len(widths): u.output for u in items if u.target == "getitem"} if widths else {}
        return _pieces(graph, [(w, outs.get(i)) for i, w in enumerate(widths[1:], 1)], tp) if widths else None
    if user.output is None or len(user.inputs) != 1:
        return None
    mapped = _mapped_dim(user, shape, graph.values[user.output].shape, dim)
    tail = tail_of_value(graph, user.output, mapped[0], tp) if mapped else None
    return tail.scaled(mapped[1]) if tail else None


def _mapped_dim(op: Op, src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> tuple[int, int] | None:
    """Where a permute or view puts ``dim`` and how many entries of it one entry there holds."""
    if op.target in VIEW_OPS:
        return _view_dim(src, dst, dim)
    order = permutation(op, len(dst))
    return (order.index(dim), 1) if order else None


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> tuple[int, int] | None:
    """Where a view puts ``dim``: ``(d, 1)`` when it keeps it whole (an ``unsqueeze`` before
    it), ``(d, unit)`` when it cuts the last dim into ``(parts, unit)``."""
    lead = [n for n in src[:dim] if n != 1]
    if any(n != 1 for n in src[dim + 1:]):
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


def _indexed(index, shape: tuple[int, ...], dim: int) -> tuple[int, int] | None:
    """``(start, stop)`` of an index that takes one run of ``dim`` (``[..., :-2, :]``,
    ``[..., [-2], :]``), every other dim kept whole; None for any other index."""
    items = index_items(index, len(shape))
    if len(items) != len(shape) or any(i != slice(None) for d, i in enumerate(items) if d != dim):
        return None
    item, size = items[dim], shape[dim]
    if isinstance(item, slice) and all(isinstance(b, (int, type(None))) for b in (item.start, item.stop, item.step)):
        start, stop, step = item.indices(size)
        return (start, stop) if step == 1 and stop > start else None
    picks = item if isinstance(item, list) else None  # an int index drops the dim: not a piece
    if picks and all(isinstance(p, int) and not isinstance(p, bool) and -size <= p < size for p in picks):
        at = sorted(p % size for p in picks)
        return (at[0], at[-1] + 1) if at == list(range(at[0], at[-1] + 1)) else None
    return None


def tail_strategies(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """An op's strategies on a whole-tail value: a view or permute carries it, a cut gives
    the lead ``Shard(d)`` and each piece ``Rp`` or ``S{d}g{kv}``."""
    if not op.inputs or len(op.inputs) != 1:
        return []
    if op.target == "getitem" and isinstance(op.node.args[0].meta.get("val"), (tuple, list)):
        return _split_item(op, graph, tp)
    src = graph.values[op.inputs[0]].shape
    out = []
    for d in range(len(src)):
        tail = tail_of_value(graph, op.inputs[0], d, tp)
        if tail is None:
            continue
        if op.target == "split":
            out.append(Strategy("", (tail.placement(d),), tail.placement(d)))  # a tuple: each item its part
        elif op.target == "getitem":
            span = _indexed(op.node.args[1], src, d)
            lead = span is not None and span[0] == 0
            out += [Strategy("", (tail.placement(d),), f"S{d}" if lead else tail.piece(d))] if span else []
        else:
            out += _carried(op, graph, tp, src, out_shape, d, tail)
    return out


def _carried(op: Op, graph: OpGraph, tp: int, src, out_shape, d: int, tail: Tail) -> list[Strategy]:
    """A view or permute of a whole-tail value: the same tail where the op puts the dim."""
    mapped = _mapped_dim(op, src, out_shape, d)
    after = tail_of_value(graph, op.output, mapped[0], tp) if mapped else None
    if after is None or after.scaled(mapped[1]) != tail:
        return []
    return [Strategy("", (tail.placement(d),), after.placement(mapped[0]))]


def _split_item(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """Item i of a ``split`` of a whole-tail value: the lead (i = 0) ``Shard(d)``, a piece
    ``Rp`` or grouped."""
    split = graph.op_of(op.node.args[0]) if "shardplan_op" in op.node.args[0].meta else None
    i = op.node.args[1] if len(op.node.args) > 1 else None
    if split is None or split.target != "split" or not isinstance(i, int) or not split.inputs:
        return []
    i %= len(op.node.args[0].meta["val"])
    out = []
    for d in range(len(graph.values[split.inputs[0]].shape)):
        tail = tail_of_value(graph, split.inputs[0], d, tp)
        if tail is not None:
            out.append(Strategy("", (tail.placement(d),), f"S{d}" if i == 0 else tail.piece(d)))
    return out


def tailed_colwise(op: Op, graph: OpGraph, tp: int, *, weight: str, inputs: list[str], common: dict) -> list[Strategy]:
    """``packed_colwise`` with ``whole_parts``: rank r computes ``[q_r, k_r, v_r]`` from
    rows ``[Q_r; K_r; V_r]`` (1/tp of each part) and all-gathers each piece over the ranks
    of its kv head, so it holds ``[q_r, k_g, v_g]``. Backward, each rank's gradient of a
    piece is its query heads' share; the gather's reduce-scatter sums the shares and keeps
    the rank's rows, so the weight's gradient is complete, and the input's is Partial, as
    colwise's is."""
    y = graph.values[op.output]
    last = len(y.shape) - 1
    tail = tail_of_value(graph, op.output, last, tp) if y.shape else None
    if tail is None or any(p % tp for p in tail.pieces):
        return []
    size, ranks = y.shape[last], tp // tail.groups
    parts = [size - tail.n, *tail.pieces]
    unit = math.gcd(*parts)
    held = y.nbytes * tail.n // size // tail.groups  # the gathered pieces, on each rank
    act = y.nbytes * ((size - tail.n) // tp + tail.n // tail.groups) / size
    layouts = {"weight": f"{weight}p{len(parts)}", "packed": [p // unit for p in parts], "whole_parts": len(tail.pieces),
               **({"groups": tail.groups} if tail.groups > 1 else {})}
    if tail.groups == 1:
        comms = dict(fwd=(("all_gather", held),), bwd=(("reduce_scatter", held),))
    else:
        comms = dict(group_comms=(("forward", "all_gather", held, ranks), ("backward", "reduce_scatter", held, ranks)))
    return [Strategy(
        "packed_colwise", (p,), tail.placement(last), entry=(p,), **comms,
        layouts={**layouts, **({"input": p} if p != "R" else {})}, **{**common, "act_bytes": act},
    ) for p in inputs]


def _tailed_linears(graph: OpGraph, tp: int) -> list[tuple[Op, Tail]]:
    """Each Linear whose output has a whole tail, with that tail."""
    out = []
    for op in graph.ops:
        shape = graph.values[op.output].shape if op.kind == "module" and op.output is not None else ()
        if op.module_kind in ("linear", "conv1d") and shape:
            tail = tail_of_value(graph, op.output, len(shape) - 1, tp)
            out += [(op, tail)] if tail else []
    return out


def tail_owners(graph: OpGraph, tp: int) -> set[str]:
    """Modules that call a Linear whose output has a whole tail: where the tail's ``Rp``
    pieces meet the split query heads (``Rp`` strategies are offered there)."""
    owners = {op.target.rpartition(".")[0] for op, tail in _tailed_linears(graph, tp) if tail.groups == 1}
    return owners - {""}  # a Linear the root calls: the whole model would take Rp strategies


def grouped_tail_values(graph: OpGraph, tp: int) -> list[int]:
    """Outputs of Linears whose tail holds kv heads in groups: where grouped values start."""
    return [op.output for op, tail in _tailed_linears(graph, tp) if tail.groups > 1]
