"""Placements: the strategy record every op and weight style is priced by, and its spelling.

Contract
--------
A placement is ``"R"`` (Replicate), ``"P"`` (Partial: each rank holds a summand),
``"S{d}"`` (Shard(d)) or ``"S{d}p{k}"`` (a packed output: ``k`` blocks along ``d``, each
sharded, as a fused gate/up projection's output). ``"Rp"`` is a whole value whose
gradient comes back Partial (MLA's shared rotary key, broadcast to heads split tp ways):
the Linear that made it sums the gradients once. Two more describe kv heads replicated
across the ranks whose query heads read them, when a model has fewer kv heads than tp:

* ``"S{d}g{n}"`` (grouped): dim ``d`` is cut into ``n`` groups (one per kv head) and rank
  ``r`` holds group ``r // (tp / n)``, so each group is on ``tp / n`` ranks. Forward values
  are equal copies within a group; their gradients are partial sums (each rank back-propagates
  only its own query heads' share), which the weight's gradient sync and the region's input
  all-reduce add up.
* ``"S{d}e{n}"`` (expanded groups): the ``repeat_kv`` expand ``[b, n, 1, s, hd] -> [b, n, g,
  s, hd]`` of a grouped value, run with ``g / (tp / n)`` copies per rank: dim ``d`` holds
  the rank's group, dim ``d + 1`` its share of the group's query heads, so merging the two
  gives exactly the rank's Shard(d) slice of the query heads.

One more holds a fused projection whose trailing part is too few heads to split (MQA's one k
and v head fused after the query heads, Falcon-7B's ``query_key_value``, StarCoder's
``c_attn``):

* ``"S{d}w{n}"`` (whole tail): the leading ``size - n`` entries of dim ``d`` are split tp
  ways and the trailing ``n`` held whole by every rank, so a rank holds ``[q_r, k, v]``. The
  tail's gradient on each rank is its own query heads' share, ``Rp`` once cut off.
  ``"S{d}w{n}g{kv}"``: the tail's pieces hold ``kv`` heads each, in groups as ``S{d}g{kv}``
  (rank r holds ``[q_r, k_g, v_g]``, g = r // (tp / kv)).

Tokens flattened with the sequence split (``[b, s, h] -> [b * s, h]``, OPT's MLP) are
``S0p{b}`` (:mod:`.folded`); gathered where a Linear receives them, a rank holds the rows in
rank order (rank 0's tokens, then rank 1's), not the model's:

* ``"S{d}o{k}"`` (rank order): split on ``d`` like ``S{d}``, its rows those of an ``S0p{k}``
  value all-gathered in rank order. Only ops that treat rows one by one read it, and a
  reduce-scatter in the same order hands each rank its own rows back (``S0p{k}``), so no row
  ever meets another in the wrong place.

A :class:`Strategy` names the placements
of an op's inputs and output, the collectives its forward and backward issue, and its
per-device bytes and flops. Nothing here knows any op: :mod:`.strategies` (plain ops) and
:mod:`.weights` (weight styles) build the strategies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..analyze.graph import Op

__all__ = ["Comm", "Strategy", "seq_dims", "shard_dim", "placement_str", "packed", "chunk_count", "split_parts", "split_widths", "slice_range", "index_items", "one_slice", "sliced_part", "narrow_index", "view_parts", "grouped", "groups_of", "group_counts", "whole_tail", "tail_of", "permutation", "rank_order",
           "view_groups", "VIEW_OPS",
           "local_shape", "ANY"]

Comm = tuple[str, int]  # (collective kind, logical bytes)
# an input placement that takes whatever its producer gives: the op reads the input's
# metadata only (dtype, device), or a folded block's inputs are tied elsewhere
ANY = "*"


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
    # (bytes, ranks): Partial weight gradients all-reduced over a sub-group of the tp axis when
    # backward ends, all of one group size in one bucket (kv heads replicated on tp / n ranks)
    group_grads: tuple[tuple[int, int], ...] = ()
    # (phase, kind, logical bytes, ranks): collectives over a sub-group of the tp axis (a kv
    # head's projection gathered across the tp / groups ranks that hold its rows)
    group_comms: tuple[tuple[str, str, float, int], ...] = ()
    # a norm kept whole that could take sequence shards, when sequence parallel was asked for
    # (``sequence_parallel=True``): the solver keeps as few of these as any plan can
    off_sequence: bool = False


# ops that reshape without moving data
VIEW_OPS = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"})


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source dims with runs of destination dims of equal product."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if (pi <= pj or j >= len(dst)) and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if pi == pj and gi and gj:
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    gi.append(i)
                    i += 1
                break
        groups.append((gi, gj))
    return groups



def expanded_dims(src: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int]:
    """The dims of an ``expand`` of ``src`` to ``out_shape`` that the expand makes (new, or
    of size 1 before), larger than 1."""
    lead = len(out_shape) - len(src)
    return [o for o, n in enumerate(out_shape) if n > 1 and (o < lead or src[o - lead] == 1)]


def seq_dims(shape: tuple[int, ...], tp: int) -> list[int]:
    """Dims an activation may be sharded on besides features (sequence parallel)."""
    return [d for d in range(len(shape) - 1) if shape[d] % tp == 0 and shape[d] >= tp and d >= 1]


def shard_dim(p: str) -> int | None:
    return int(re.match(r"S(\d+)", p).group(1)) if p.startswith("S") else None


def grouped(dim: int, num_groups: int, *, expanded: bool = False) -> str:
    """``S{dim}g{n}`` (kv heads replicated in ``n`` groups) or its expansion ``S{dim}e{n}``."""
    return f"S{dim}{'e' if expanded else 'g'}{num_groups}"


def whole_tail(dim: int, n: int, groups: int = 1) -> str:
    """``S{dim}w{n}``: dim ``dim`` split tp ways but for its last ``n`` entries, held whole;
    ``S{dim}w{n}g{groups}``: those held in ``groups`` kv-head groups, as ``S{d}g{n}`` holds them."""
    return f"S{dim}w{n}" + (f"g{groups}" if groups > 1 else "")


def tail_of(p: str | None) -> tuple[int, int] | None:
    """``(n, groups)`` of a whole-tail placement; None for any other."""
    m = re.fullmatch(r"S\d+w(\d+)(?:g(\d+))?", p or "")
    return (int(m.group(1)), int(m.group(2) or 1)) if m else None


def rank_order(dim: int, k: int) -> str:
    """``S{dim}o{k}``: split on ``dim``, its rows those of a ``S0p{k}`` value gathered in rank order."""
    return f"S{dim}o{k}"


def permutation(op: Op, ndim: int) -> list[int] | None:
    """Output dim -> input dim of ``transpose``, ``swapaxes``, ``t`` or ``permute``; None for any other op."""
    args = [a for a in op.node.args[1:]]
    name = op.target
    order = list(range(ndim))
    if name in ("transpose", "swapaxes", "swapdims") and len(args) == 2:
        a, b = (int(x) % ndim for x in args)
        order[a], order[b] = order[b], order[a]
        return order
    if name == "t":
        return order[::-1]
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return [int(x) % ndim for x in dims]
    return None


def group_counts(tp: int) -> list[int]:
    """Group counts a kv-grouped value may have at this tp: divisors strictly between 1 and tp."""
    return [n for n in range(2, tp) if tp % n == 0]


def groups_of(p: str) -> tuple[str, int] | None:
    """``("g", n)`` or ``("e", n)`` of a grouped placement; None for any other."""
    m = re.fullmatch(r"S\d+([ge])(\d+)", p)
    return (m.group(1), int(m.group(2))) if m else None


def local_shape(shape: tuple[int, ...], p: str, tp: int) -> tuple[int, ...]:
    """One rank's shape of a value placed ``p``: a Shard(d) value holds 1/tp of dim d, a
    grouped one 1/n of it, an expanded one also 1/(tp/n) of dim d + 1, a whole-tail one
    1/tp of its head and all of its tail."""
    d = shard_dim(p)
    if d is None:
        return tuple(shape)
    kind, n = groups_of(p) or ("", tp)
    out = list(shape)
    tail = tail_of(p)
    if tail is not None:
        out[d] = (out[d] - tail[0]) // tp + tail[0] // tail[1]
        return tuple(out)
    out[d] //= n
    if kind == "e":
        out[d + 1] //= tp // n
    return tuple(out)


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


def split_parts(op: Op, size: int) -> int | None:
    """The number of equal parts a split of a dim of ``size`` cuts: ``chunk(k)``,
    ``split(width)`` (nanoGPT's ``split(self.n_embd)``), ``split([w, w, w])`` and
    ``tensor_split(k)``; None for unequal parts or any other op. A packed projection
    [q; k; v] cut so hands each part to its consumer, and a rank that holds its slice of
    every part (``S{d}p{k}``) cuts the local tensor into exactly those slices."""
    if op.target == "chunk":
        return chunk_count(op)
    if op.target not in ("split", "tensor_split"):
        return None
    arg = op.node.kwargs.get("split_size_or_sections", op.node.kwargs.get("sections", op.node.args[1] if len(op.node.args) > 1 else None))
    if op.target == "tensor_split" and isinstance(arg, int):
        k = arg
    elif isinstance(arg, int) and arg > 0 and size % arg == 0:
        k = size // arg
    elif isinstance(arg, (list, tuple)) and arg and all(type(w) is int and w == arg[0] for w in arg) and sum(arg) == size:
        k = len(arg)
    else:
        return None
    return k if k > 1 and size % k == 0 else None


def split_widths(op: Op, size: int) -> tuple[int, ...] | None:
    """The widths of the parts a ``split`` by a list of sections cuts a dim of ``size`` into
    (GQA's ``split([h * hd, kv * hd, kv * hd])``), equal or not; None for any other op."""
    if op.target != "split":
        return None
    arg = op.node.kwargs.get("split_size_or_sections", op.node.args[1] if len(op.node.args) > 1 else None)
    if isinstance(arg, (list, tuple)) and len(arg) > 1 and all(type(w) is int and w > 0 for w in arg) and sum(arg) == size:
        return tuple(arg)
    return None


def index_items(index: Any, ndim: int) -> list:
    """The items of ``x[index]`` for an ``ndim``-dim ``x``, an ``...`` written out as the ``:``
    it stands for (``None`` items add dims and take none)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        k = items.index(Ellipsis)
        fill = ndim - sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:k] + [slice(None)] * fill + items[k + 1:]
    return items


def one_slice(index: Any) -> slice | None:
    """The only slice of ``x[index]`` that is not ``:``, when its bounds are plain ints (not
    values the trace computed); None for any other index."""
    items = index if isinstance(index, tuple) else (index,)
    cut = [i for i in items if isinstance(i, slice) and i != slice(None)]
    if len(cut) != 1 or not all(isinstance(b, (int, type(None))) for b in (cut[0].start, cut[0].stop, cut[0].step)):
        return None
    return cut[0]


def slice_range(index: Any, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(d, start, stop)`` when ``x[index]`` takes one contiguous range of dim ``d`` and keeps
    every other dim whole; None for any other index."""
    items = index_items(index, len(shape))
    cut = one_slice(index)
    if cut is None or len(items) > len(shape) or not all(isinstance(i, slice) for i in items):
        return None
    d = next(d for d, i in enumerate(items) if i is cut)
    start, stop, step = cut.indices(shape[d])
    return (d, start, stop) if step == 1 and stop > start else None


def sliced_part(index: Any, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(d, k)`` when ``x[index]`` slices dim ``d`` to exactly one of ``k`` equal blocks, its
    width (phi3's ``qkv[..., :query_pos]``, ``qkv[..., q:q + kv]``), every other dim kept
    whole; None for any other index."""
    found = slice_range(index, shape)
    if found is None:
        return None
    d, start, stop = found
    width = stop - start
    if shape[d] % width or start % width or shape[d] // width < 2:
        return None
    return d, shape[d] // width


def narrow_index(args: tuple, ndim: int) -> tuple | None:
    """``x.narrow(dim, start, length)`` as the index ``x[..., start:start + length, ...]``."""
    if len(args) != 4 or not all(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]):
        return None
    dim, start, length = args[1] % ndim, args[2], args[3]
    return (slice(None),) * dim + (slice(start, start + length),)


def view_parts(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, int] | None:
    """``(d, k)`` when a view cuts the last dim ``d`` of ``src`` into ``(k, heads, ...)`` and
    keeps the others (timm's ``reshape(B, N, 3, heads, head_dim)``): the outermost factor
    names the parts of a packed projection, the next one is split across ranks."""
    d = len(src) - 1
    if d < 0 or len(dst) < len(src) + 2 or tuple(dst[:d]) != tuple(src[:d]) or dst[d] < 2:
        return None
    rest = 1
    for n in dst[d:]:
        rest *= n
    return (d, dst[d]) if rest == src[d] else None