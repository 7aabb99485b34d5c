"""Folded heads: a dim split across ranks, merged into an outer dim by a view, and back.

Contract
--------
``folded_values(graph, tp)`` maps each value a folded placement can reach to the block
counts it may carry; ``folded_view_strategies`` gives a view op the strategies that fold a
split dim into the dims outside it or unfold it again, and ``folded_variants`` the folded
twins of an op's shard-local strategies. Nothing here is offered unless an op reads a value
:func:`folded_values` lists, so a model without such views plans with the program it
always had.

fairseq, Megatron's legacy core attention and code written after them fold the heads into
the batch for ``torch.bmm``: ``q.view(b, s, h, d).transpose(1, 2).reshape(b * h, s, d)``.
With q split by heads (``Shard(1)`` of ``[b, h, s, d]``), a rank's local tensor views to
``[b * h / tp, s, d]``: ``b`` blocks of its ``h / tp`` heads. In the global ``[b * h, s, d]``
that is the packed placement ``S0p{b}`` (:func:`.placements.packed`: ``b`` equal blocks
along dim 0, each split tp ways), the layout ``_StridedShard`` describes. Ops that treat dim 0
index by index (the batched matmuls, softmax over the last dim, a mask broadcast along the
other dims) run on the blocks as they run on a contiguous shard, so their shard-local
strategies hold with ``S0`` read as ``S0p{b}``; the view back to ``[b, h, s, d]`` unfolds
the blocks into the heads' ``Shard(1)``, and the head count the code views by is made local
by the local check, as for any view of heads.

Tokens are folded the same way: OPT flattens its residual stream before the MLP
(``hidden.reshape(-1, h)``), so with the sequence split (``Shard(1)`` of ``[b, s, h]``) the
tokens are ``S0p{b}`` of ``[b * s, h]``. A norm runs on them per token
(``sequence_parallel`` on dim 0). A colwise Linear all-gathers them where it receives them
(:func:`folded_module_twins`), which puts the rows in rank order, not the model's (``S{d}o{k}``,
:mod:`.placements`); elementwise ops carry that (:func:`rank_order_twins`), and a rowwise
Linear reduce-scatters its output in the same order, so each rank gets its own tokens back,
``S0p{b}``, at any batch size, and the view back to ``[b, s, h]`` unfolds them to ``Shard(1)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace

from ..analyze.graph import Op, OpGraph
from .placements import ANY, VIEW_OPS, Strategy, expanded_dims, packed, rank_order, shard_dim, view_groups

__all__ = ["folded_values", "folded_view", "folded_view_strategies", "folded_variants", "folded_factory_strategies",
           "parts_of", "folded_module_twins", "rank_order_twins"]

_DEPTH = 32  # ops from the fold to the unfold: bmm, scale, mask, softmax, dropout, bmm, view


def parts_of(p: str | None) -> int:
    """``k`` of a packed placement ``S{d}p{k}``; 1 for any other."""
    m = re.fullmatch(r"S\d+p(\d+)", p or "")
    return int(m.group(1)) if m else 1


def folded_view(src: tuple[int, ...], dst: tuple[int, ...], d: int, parts: int, tp: int) -> str | None:
    """Where a view of ``src`` to ``dst`` puts dim ``d`` split tp ways in ``parts`` blocks
    (1: a plain ``Shard(d)``): ``S{o}`` or ``S{o}p{k}``, or None when no placement holds it.

    Within the group of dims the view merges and splits, the local elements are
    ``outer * parts`` blocks of ``size / parts * inner`` elements each, every block cut tp
    ways; an output dim ``o`` holds that layout when the dims before it in the group give
    ``outer * parts / k`` blocks for some ``k`` dividing ``dst[o]``, and ``dst[o] / k`` times
    the dims after it is the block again, cut tp ways."""
    for gi, gj in view_groups(tuple(src), tuple(dst)):
        if d not in gi:
            continue
        outer = math.prod(src[k] for k in gi if k < d)
        inner = math.prod(src[k] for k in gi if k > d)
        if src[d] % (parts * tp):
            return None
        blocks, block = outer * parts, src[d] // parts * inner
        for o in (k for k in gj if dst[k] > 1):
            before = math.prod(dst[k] for k in gj if k < o)
            after = math.prod(dst[k] for k in gj if k > o)
            if blocks % before or dst[o] % (blocks // before):
                continue
            k = blocks // before
            if dst[o] // k * after == block and (dst[o] // k) % tp == 0:
                return f"S{o}" if k == 1 else packed(o, k)
        return None
    return None


def _view_sizes(op: Op, graph: OpGraph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return graph.values[op.inputs[0]].shape, graph.values[op.output].shape


def _folds(op: Op, graph: OpGraph, tp: int, parts_in: frozenset[int]) -> list[tuple[str, str]]:
    """(input, output) placements of a view that fold or unfold (a block count > 1 on a side)."""
    src, dst = _view_sizes(op, graph)
    found = []
    for d, n in enumerate(src):
        for parts in sorted({1} | parts_in):
            out = folded_view(src, dst, d, parts, tp) if n % (parts * tp) == 0 else None
            if out is None or (parts == 1 and not _folds_into_a_batch(out, dst)):
                continue
            found.append((f"S{d}" if parts == 1 else packed(d, parts), out))
    return found


def _folds_into_a_batch(out: str, dst: tuple[int, ...]) -> bool:
    """A fold into a dim that is not the last: heads into the batch (``[b * h, s, d]``), not
    ``[b, s, h * d]`` with ``d`` split (the features of heads cut within each head, which no
    plan wants and every op after it would be offered)."""
    return parts_of(out) > 1 and shard_dim(out) != len(dst) - 1


def folded_values(graph: OpGraph, tp: int) -> dict[int, frozenset[int]]:
    """Value -> block counts it may carry: from each view that folds a dim tp divides into
    the dims outside it, forward through the ops after it."""
    key = ("folded_values", tp)
    cached = graph.strategy_cache.get(key)
    if cached is None:
        found: dict[int, set[int]] = {}
        frontier = [(op.output, parts_of(out)) for op in graph.ops if _is_view(op)
                    for _, out in _folds(op, graph, tp, frozenset()) if parts_of(out) > 1]
        for _ in range(_DEPTH):
            frontier = [(v, k) for v, k in frontier if k not in found.get(v, ())]
            for v, k in frontier:
                found.setdefault(v, set()).add(k)
            frontier = [(graph.ops[c].output, k) for v, k in frontier for c in graph.consumers.get(v, [])
                        if graph.ops[c].output is not None and graph.ops[c].kind in ("function", "module")]
        cached = graph.strategy_cache[key] = {v: frozenset(k) for v, k in found.items()}
    return cached


def _is_view(op: Op) -> bool:
    return op.kind == "function" and op.target in VIEW_OPS and op.output is not None and bool(op.inputs)


def folded_view_strategies(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """A view that folds a split dim into the dims outside it (``S{d}`` -> ``S{o}p{k}``), or
    unfolds a folded one (``S{o}p{k}`` -> ``S{d}``); the other operands (sizes) stay whole."""
    if not _is_view(op):
        return []
    parts_in = folded_values(graph, tp).get(op.inputs[0], frozenset())
    rest = ("R",) * (len(op.inputs) - 1)
    return [Strategy("", (p,) + rest, out) for p, out in _folds(op, graph, tp, parts_in)]


# tensors made from sizes alone, every element the same (or unread: baddbmm's beta=0 buffer)
_FACTORIES = {"empty", "zeros", "ones", "full"}


def folded_factory_strategies(op: Op, graph: OpGraph, tp: int, out_shape: tuple[int, ...]) -> list[Strategy]:
    """``torch.empty(b * heads, s, s)`` beside folded values (Megatron's buffer for
    ``baddbmm``), or a whole mask expanded to ``b * heads`` rows: a rank's piece of a constant
    tensor, or of one repeated along a dim, is that tensor at the local size, so it may take
    the folded placements its consumers read. The code must size it locally (``b *
    self.num_heads`` with the local count), which the local check proves.

    A constant made from sizes alone may also be split as a plain ``Shard(d)``: T5's
    cross-attention adds ``torch.zeros(1, self.n_heads, q, k)`` to scores split by heads
    (the local check then finds ``n_heads`` its local value), and a recurrent state starts
    as ``torch.zeros(b, heads, dk, dv)``."""
    plain = op.target in _FACTORIES and not op.inputs and op.node.op == "call_function"
    if op.target == "expand" and len(op.inputs) == 1:  # a whole value expanded along a dim: every block a copy
        dims = expanded_dims(graph.values[op.inputs[0]].shape, out_shape)
    elif plain:
        dims = list(range(len(out_shape)))
    else:
        return []
    folds = folded_values(graph, tp)
    counts = sorted({k for c in graph.consumers.get(op.output, []) for v in graph.ops[c].inputs for k in folds.get(v, ())})
    split = [Strategy("", (), f"S{d}") for d in dims if plain and out_shape[d] % tp == 0 and out_shape[d] >= tp]
    return split + [Strategy("", ("R",) * len(op.inputs), packed(d, k)) for k in counts for d in dims
                    if out_shape[d] % (k * tp) == 0]


def folded_variants(op: Op, graph: OpGraph, tp: int, strategies: list[Strategy],
                    shape: Callable[[int], tuple[int, ...]], out_shape: tuple[int, ...]) -> list[Strategy]:
    """Folded twins of ``strategies`` (an op that is not a view): each ``S{d}`` read as
    ``S{d}p{k}``, for the block counts ``k`` of the folded values the op reads. Only
    strategies whose split dims all keep one size qualify (the op then treats that dim index
    by index, so blocks of it behave as a contiguous shard does)."""
    folds = folded_values(graph, tp)
    counts = sorted(set().union(*(folds.get(v, frozenset()) for v in op.inputs)))
    out = []
    for k in counts:
        for s in strategies:
            twin = _twin(s, k, [shape(v) for v in op.inputs], out_shape, tp)
            if twin is not None:
                out.append(twin)
    return out


def _twin(s: Strategy, k: int, shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], tp: int) -> Strategy | None:
    # an input read for its dtype or shape alone (``ANY``: ``type_as``'s second) stays as it is
    places = [(p, shape) for p, shape in [*zip(s.inputs, shapes), (s.output, out_shape)] if p != ANY]
    if s.name or any(p not in ("R",) and not re.fullmatch(r"S\d+", p or "") for p, _ in places):
        return None  # Partial, grouped, packed and weight strategies have no folded twin
    if any(p != "R" and shard_dim(p) >= len(shape) for p, shape in places):
        return None  # a tuple's placement read against its first tensor's shape
    sizes = {shape[shard_dim(p)] for p, shape in places if p != "R"}
    if len(sizes) != 1 or next(iter(sizes)) % (k * tp):
        return None

    def fold(p: str) -> str:
        return p if p in ("R", ANY) else packed(shard_dim(p), k)

    return Strategy("", tuple(fold(p) for p in s.inputs), fold(s.output))


def folded_module_twins(op: Op, graph: OpGraph, tp: int, strategies: list[Strategy]) -> list[Strategy]:
    """A Linear reading tokens folded ``S0p{k}`` (sequence parallel): colwise gathering them
    where it receives them (its rows then in rank order, ``S{last}o{k}``); rowwise reading
    rows in rank order and reduce-scattering its output back to ``S0p{k}``."""
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    if len(x.shape) != 2:
        return []
    out = []
    for k in sorted(folded_values(graph, tp).get(op.inputs[0], frozenset())):
        p = packed(0, k)
        if x.shape[0] % (k * tp):
            continue
        for s in strategies:
            if s.name == "colwise" and s.inputs == ("R",) and not s.layouts.get("output"):
                out.append(replace(s, inputs=(p,), output=rank_order(shard_dim(s.output), k), entry=(p,),
                                   layouts={**s.layouts, "input": p}))
            elif s.name == "rowwise" and s.output == "R" and s.inputs == ("S1",):
                out.append(replace(s, inputs=(rank_order(1, k),), output=p, fwd=(("reduce_scatter", y.nbytes),),
                                   bwd=(("all_gather", y.nbytes),), act_bytes=s.act_bytes / tp, layouts={**s.layouts, "output": p}))
    return out


def rank_order_twins(op: Op, graph: OpGraph, tp: int, strategies: list[Strategy]) -> list[Strategy]:
    """An op acting entry by entry (an activation, dropout) on rows in rank order: as on
    ``S{last}``, the features a colwise Linear split."""
    counts = folded_values(graph, tp).get(op.inputs[0], frozenset()) if len(op.inputs) == 1 else ()
    last = f"S{len(graph.values[op.output].shape) - 1}"
    return [Strategy("", (rank_order(shard_dim(last), k),), rank_order(shard_dim(last), k))
            for k in sorted(counts) if any(not s.name and s.inputs == (last,) and s.output == last for s in strategies)]
