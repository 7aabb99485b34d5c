"""Heads shared across ranks: the strategies for fewer kv heads than tp and for MLA's shared key.

Contract
--------
``grouped_variants`` and ``grouped_conversions`` give an op its strategies on kv-grouped
values (``S{d}g{n}``, ``S{d}e{n}``: :mod:`.placements`), from a shard-local rule of
:mod:`.strategies` run with the group count as the divisor, and from the three ops that turn
grouped kv heads into the query heads' ``Shard``. ``partial_grad_twins`` gives the ``Rp``
twins of an op's strategies (a whole value whose gradient comes back Partial). Nothing
here is used unless :func:`grouped_values` or :func:`under_partial_grad_owner` says the op
can meet such values (a k/v projection with fewer heads than tp upstream; a module that
broadcasts a whole value to heads).
"""

from __future__ import annotations

import math

from ..analyze.graph import Op, OpGraph
from .buffers import written_buffers
from .placements import ANY, VIEW_OPS, Strategy, group_counts, grouped, shard_dim, view_groups
from .propagation import in_place_strategies
from .tails import grouped_tail_values, tail_owners

__all__ = ["grouped_variants", "grouped_writes", "grouped_conversions", "partial_grad_twins", "grouped_values", "viewed_heads",
           "partial_grad_owners", "under_partial_grad_owner", "BROADCASTS", "kv_replicated_strategies", "partial_grad_linear_strategies"]


def _shape_of(graph: OpGraph, value: int) -> tuple[int, ...]:
    return graph.values[value].shape


# Fewer kv heads than tp (see :mod:`.placements` for ``S{d}g{n}`` and ``S{d}e{n}``). Between
# the k/v projections and the repeat that lines kv heads up with query heads, a grouped value
# goes through the same shard-local ops a sharded one does (views, RoPE, a per-head norm):
# each rank holds one kv head, and the rules hold with the group count as the divisor.


def grouped_variants(op: Op, graph: OpGraph, tp: int, out_shape, rule) -> list[Strategy]:
    """``rule``'s shard-local strategies with ``n`` groups in place of ``tp`` shards, on dims
    that hold the groups themselves (size ``n``: kv heads) or features (the last dim)."""
    out = []
    for n in group_counts(tp):
        for s in rule(op, graph, n, out_shape):
            places = s.inputs + (s.output,)
            if "P" in places or s.output is None or any("p" in p for p in places if p):
                continue
            if shard_dim(s.output) is None or not _group_dims_ok(op, graph, s, n, out_shape):
                continue
            out.append(Strategy("", tuple(_as_group(p, n) for p in s.inputs), _as_group(s.output, n)))
    return out


def grouped_writes(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """A write of grouped kv heads into a cache split as they are (``cache_k[:b, p:p + s] =
    xk`` with ``xk`` and ``cache_k`` both ``S2g{n}``): each rank writes its group into its
    group's chunk, the write DTensor runs shard-locally with ``n`` shards."""
    out = []
    for n in group_counts(tp):
        for ins in in_place_strategies(op, graph, tp=n):
            s = Strategy("", ins, None)
            if _group_dims_ok(op, graph, s, n, None):
                out.append(Strategy("", tuple(_as_group(p, n) for p in ins), None))
    return out


def _as_group(p: str, n: int) -> str:
    d = shard_dim(p)
    return p if d is None else grouped(d, n)


def _group_dims_ok(op: Op, graph: OpGraph, s: Strategy, n: int, out_shape) -> bool:
    shapes = [_shape_of(graph, v) for v in op.inputs] + [out_shape]
    for p, shape in zip(s.inputs + (s.output,), shapes):
        d = shard_dim(p or "R")
        if d is not None and shape[d] != n and d != len(shape) - 1:
            return False
    return True


def grouped_conversions(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """Where grouped kv heads meet the query heads' Shard: the expand of ``repeat_kv`` and the
    reshape after it, ``repeat_interleave`` by the group size, or attention with
    ``enable_gqa=True``. The repeat's size is the code's own (``self.num_key_value_groups``):
    the local check finds it must be ``g / (tp / n)`` on a rank and says so in the plan."""
    if not op.inputs or op.output is None:
        return []
    src, rest = _shape_of(graph, op.inputs[0]), ("R",) * (len(op.inputs) - 1)
    out = []
    for n in group_counts(tp):
        rep = tp // n
        if op.target in ("expand", "expand_as"):
            lead = len(out_shape) - len(src)
            out += [Strategy("", (grouped(d, n),) + rest, grouped(d + lead, n, expanded=True))
                    for d in range(len(src) - 1) if src[d] == n == out_shape[d + lead] and src[d + 1] == 1
                    and out_shape[d + lead + 1] % rep == 0 and out_shape[d + lead + 1] > 1]
        elif op.target in VIEW_OPS:
            out += [Strategy("", (grouped(d, n, expanded=True),) + rest, f"S{o}")
                    for d, o in _merged_pairs(src, out_shape) if src[d] == n and out_shape[o] % tp == 0]
        elif op.target == "repeat_interleave":
            out += _repeat_interleave(op, src, n, rep)
        elif op.target == "scaled_dot_product_attention" and op.node.kwargs.get("enable_gqa") is True:
            heads = [_shape_of(graph, v)[1] if len(_shape_of(graph, v)) == 4 else 0 for v in op.inputs[:3]]
            if len(heads) == 3 and heads[1] == heads[2] == n and heads[0] % tp == 0:
                out.append(Strategy("", ("S1", grouped(1, n), grouped(1, n)) + ("R",) * (len(op.inputs) - 3), "S1"))
    return out


def _merged_pairs(src, dst) -> list[tuple[int, int]]:
    """(d, o): source dims d and d + 1 (and nothing else of size > 1) become destination dim o."""
    pairs = []
    for gi, gj in view_groups(tuple(src), tuple(dst)):
        big_in = [k for k in gi if src[k] != 1]
        big_out = [k for k in gj if dst[k] != 1]
        if len(big_in) == 2 and big_in[1] == big_in[0] + 1 and len(big_out) == 1:
            pairs.append((big_in[0], big_out[0]))
    return pairs


def _repeat_interleave(op: Op, src, n: int, rep: int) -> list[Strategy]:
    """``x.repeat_interleave(g, dim=d)`` on ``n`` grouped kv heads: each rank repeats its one
    kv head ``g / rep`` times, which is its slice of the ``n * g`` query heads."""
    args, kw = op.node.args, op.node.kwargs
    repeats = kw.get("repeats", args[1] if len(args) > 1 else None)
    dim = kw.get("dim", args[2] if len(args) > 2 else None)
    if not isinstance(repeats, int) or not isinstance(dim, int) or repeats % rep or len(op.inputs) != 1:
        return []
    d = dim % len(src)
    return [Strategy("", (grouped(d, n),), f"S{d}")] if src[d] == n else []


# A whole value broadcast into computation split by heads (MLA's shared rotary key, ``k_rot``
# [b, 1, s, r] expanded to every head): forward each rank slices it for free, but its
# gradient on each rank sums that rank's heads only. Placed ``Rp`` ("replicated, gradient
# Partial"), the value and everything computed from it up to the Linear that made it carry
# partial gradients, and that Linear sums them once: a gathered colwise output's backward
# becomes a reduce-scatter, a norm's weight gradient is all-reduced when backward ends.


_SHAPE_SOURCE = frozenset({"type_as", "view_as", "reshape_as", "expand_as"})


def partial_grad_twins(op: Op, graph: OpGraph, tp: int, strategies: list[Strategy], out_shape) -> list[Strategy]:
    """``Rp`` twins: a strategy reading gradient-needing values whole (``R``) reads them ``Rp``
    instead, its output ``Rp`` when it was ``R``; the broadcast of an ``Rp`` value into a
    split output (``expand`` to the rank's heads) is allowed, its partial gradient being
    what the producer expects. Every gradient-needing input must be ``Rp``: one summed and
    one whole gradient cannot share a reduction."""
    out = []
    for s in strategies:  # a product with a partial sum (``R * P -> P``) scales it: the same holds
        if s.output not in ("R", "P") and shard_dim(s.output or "") is None:
            continue
        if any(p not in ("R", "P", ANY) and shard_dim(p) is None for p in s.inputs):
            continue  # (``ANY``: read for its dtype, ``self.cache_k.to(xq)``)
        ins = tuple("Rp" if p == "R" and v in graph.requires_grad else p for p, v in zip(s.inputs, op.inputs))
        # ``w.type_as(x)``, ``y.view_as(x)`` read ``x`` for its dtype or shape, whichever way it is
        # whole: no gradient reaches it (mistral's MoE reads its gathered input so)
        shape_read = [ins[:1] + ("R",) + ins[2:]] if op.target in _SHAPE_SOURCE and ins[1:2] == ("Rp",) else []
        for read in [ins] + shape_read:
            if "Rp" in read:  # a value no gradient reaches (top-k's indices) is plainly whole
                whole = s.output == "R" and op.output in graph.requires_grad
                out.append(Strategy(s.name, read, "Rp" if whole else s.output))
    if op.target in BROADCASTS and len(op.inputs) >= 1:
        src = _shape_of(graph, op.inputs[0])
        lead = len(out_shape) - len(src)
        out += [Strategy("", ("Rp",) + ("R",) * (len(op.inputs) - 1), f"S{d + lead}") for d, n in enumerate(src)
                if n == 1 and out_shape[d + lead] % tp == 0 and out_shape[d + lead] >= tp]
    return out


def viewed_heads(op: Op, graph: OpGraph, tp: int) -> list[int]:
    """Head counts below tp (and dividing it) that a view splits this Linear's output features
    into, ``[b, s, kv * hd] -> [b, s, kv, hd]``, directly or after ops that keep its shape."""
    values, found = [op.output], set()
    for _ in range(3):
        nxt = []
        for v in values:
            src = graph.values[v].shape
            for user in (graph.ops[c] for c in graph.consumers.get(v, [])):
                dst = graph.values[user.output].shape if user.output is not None else None
                if dst is None or user.kind != "function":
                    continue
                i = len(src) - 1
                if dst[:i] == src[:i] and len(dst) > i + 1 and math.prod(dst[i:]) == src[i]:
                    found.add(dst[i])
                elif dst == src and len(user.inputs) == 1:
                    nxt.append(user.output)
        values = nxt
    return sorted(n for n in found if n in group_counts(tp))


def grouped_values(graph: OpGraph, tp: int) -> frozenset[int]:
    """Values a kv-grouped placement can reach: from each Linear whose output a view splits
    into fewer heads than tp, forward through the ops after it (the repeat that turns the
    groups into query heads ends it a few ops later). Only ops reading these get grouped
    strategies, so a model without such heads plans with the program it always had."""
    key = ("grouped_values", tp)
    cached = graph.strategy_cache.get(key)
    if cached is None:
        found: set[int] = set()
        frontier = [op.output for op in graph.ops if op.kind == "module" and op.module_kind == "linear"
                    and op.output is not None and viewed_heads(op, graph, tp)] + grouped_tail_values(graph, tp)
        if frontier:  # a cache the grouped kv heads are written into, read back as they are
            frontier += [graph.ops[i].output for i in written_buffers(graph)]
        for _ in range(_GROUPED_DEPTH):
            frontier = [v for v in frontier if v not in found]
            found.update(frontier)
            frontier = [graph.ops[c].output for v in frontier for c in graph.consumers.get(v, [])
                        if graph.ops[c].output is not None and graph.ops[c].kind in ("function", "module")]
        cached = graph.strategy_cache[key] = frozenset(found)
    return cached


_GROUPED_DEPTH = 48  # ops from a k/v projection to attention: view, norm, RoPE, repeat, sdpa


def partial_grad_owners(graph: OpGraph, tp: int) -> frozenset[str]:
    """Modules whose own code expands a size-1 dim of a gradient-needing value to a size tp
    divides (a shared key broadcast to every head), or scales values by such a one (a gate
    ``sigmoid(gate(x))`` of ``[tokens, 1]`` times a shared expert's partial sums, Qwen2-MoE's),
    or cuts a whole tail off a fused projection (:mod:`.tails`): where ``Rp`` strategies are
    offered."""
    key = ("partial_grad_owners", tp)
    cached = graph.strategy_cache.get(key)
    if cached is None:
        found = set()
        for op in graph.ops:
            if op.target in BROADCASTS and op.output is not None and op.inputs \
                    and op.inputs[0] in graph.requires_grad and _expands_to_split(op, graph, tp) \
                    and not _merged_after(op, graph):
                found.add(op.owner)
            elif op.target == "mul" and _scales_by_broadcast(op, graph):
                found.add(op.owner)
            elif op.target in _MATMULS and _broadcast_operand(op, graph, tp):
                found.add(op.owner)
        found |= tail_owners(graph, tp)  # one kv head cut off a fused projection, whole on every rank
        cached = graph.strategy_cache[key] = frozenset(found)
    return cached


def _scales_by_broadcast(op: Op, graph: OpGraph) -> bool:
    """``a * b`` where a gradient-needing operand is broadcast along a dim the other has
    whole (``[t, 1] * [t, h]``): with ``b`` split or partial, ``a``'s gradient is a partial sum."""
    shapes = [_shape_of(graph, v) if v in graph.values else None for v in op.inputs]
    if len(shapes) != 2 or None in shapes or len(shapes[0]) != len(shapes[1]):
        return False
    for (a, b), v in zip((shapes, shapes[::-1]), op.inputs):
        if v in graph.requires_grad and any(x == 1 < y for x, y in zip(a, b)):
            return True
    return False


# ops that copy a size-1 dim of a value to every head: ``expand`` (MLA's shared key, HF's
# repeat_kv of one kv head), and ``repeat_interleave``/``repeat`` of one kv head (MQA as
# hand-written code spells it: ``k.repeat_interleave(n_head, dim=1)``)
BROADCASTS = ("expand", "expand_as", "repeat_interleave", "repeat")


def under_partial_grad_owner(fqn: str, graph: OpGraph, tp: int) -> bool:
    """``fqn`` is such a module or inside one (its RoPE submodule)."""
    return any(fqn == o or fqn.startswith(o + ".") or not o for o in partial_grad_owners(graph, tp))


_MATMULS = ("matmul", "__matmul__")


def _broadcast_operand(op: Op, graph: OpGraph, tp: int) -> bool:
    """A matmul broadcasting a gradient-needing operand along a batch dim the other has (and
    tp divides): Falcon's one kv head, ``q @ k.transpose(-1, -2)`` with q ``[b, heads, s, d]``
    and k ``[b, 1, s, d]``, the same key read by every head with no ``expand``."""
    if len(op.inputs) != 2 or op.output is None:
        return False
    out = graph.values[op.output].shape
    for v in op.inputs:
        shape = graph.values[v].shape
        lead = len(out) - len(shape)
        if v in graph.requires_grad and any(
                (d < lead or shape[d - lead] == 1) and out[d] % tp == 0 and out[d] >= tp for d in range(len(out) - 2)):
            return True
    return False


def _expands_to_split(op: Op, graph: OpGraph, tp: int) -> bool:
    src, out = graph.values[op.inputs[0]].shape, graph.values[op.output].shape
    lead = len(out) - len(src)
    return any(n == 1 and out[d + lead] % tp == 0 and out[d + lead] >= tp for d, n in enumerate(src))


def _merged_after(op: Op, graph: OpGraph) -> bool:
    """The expand of ``repeat_kv`` (``[b, kv, 1, s, d] -> [b, kv, g, s, d]``, then reshaped
    to ``kv * g`` heads) copies heads rather than broadcasting one value to all of them;
    with one kv head (MQA, ``kv == 1``) it does broadcast it, as MLA's shared key is."""
    users = [graph.ops[c] for c in graph.consumers.get(op.output, [])]
    src, ndim = graph.values[op.inputs[0]].shape, len(graph.values[op.output].shape)
    lead = ndim - len(src)
    grown = [d for d, n in enumerate(src) if n == 1 and graph.values[op.output].shape[d + lead] > 1]
    if grown and all(d > 0 and src[d - 1] == 1 for d in grown):
        return False
    return bool(users) and all(u.target in ("reshape", "view", "flatten") and u.output is not None
                               and len(graph.values[u.output].shape) < ndim for u in users)


# The Linear styles of heads shared across ranks (:mod:`.weights` offers them)


def partial_grad_linear_strategies(y, tp: int, col_w: str, col: dict, *, n_out: int, pbytes: float, flops: float,
                                   grad_allreduces: tuple, seq: list[int]) -> list[Strategy]:
    """Inside a module that broadcasts a whole value to heads split tp ways (MLA): the
    gathered colwise output ``Rp``, its gradient a partial sum, so the all-gather's backward
    is a reduce-scatter (not a slice) and the weight's gradient is complete; the whole module
    with an ``Rp`` output (the low-rank projection replicated, as the DeepSeek recipe keeps
    it): its weight's gradient and its input's are partial sums, the first all-reduced when
    backward ends, the second by the region with its siblings'; and colwise on an ``Rp``
    input, whose Partial input gradient is left for that producer to sum. The first two also
    take a sequence-sharded input, gathered on entry like colwise's."""
    last = len(y.shape) - 1
    out = []
    for p in ["R"] + [f"S{d}" for d in seq]:
        given = {"input": p} if p != "R" else {}
        out += [Strategy(
            "colwise_gather_output", (p,), "Rp", fwd=(("all_gather", y.nbytes),), bwd=(("reduce_scatter", y.nbytes),),
            entry=(p,), layouts={"weight": col_w, "output": "R", "output_grad": "P", **given}, **col,
        )] if n_out >= tp else []  # a 1-feature gate (Qwen2-MoE's) would leave ranks empty
        out += [Strategy(
            "replicated_with_grad_allreduce", (p,), "Rp", bwd=grad_allreduces, entry=(p,),
            param_bytes=pbytes, flops=flops, act_bytes=y.nbytes,
            layouts={"weight": "R", "output_grad": "P", **given},
        )]
    if n_out % tp == 0:
        out.append(Strategy("colwise", ("Rp",), f"S{last}", layouts={"weight": col_w, "input_grad": "P"}, **col))
    return out


def kv_replicated_strategies(y, module, pbytes: int, flops: float, tp: int, *, heads: list[int],
                             seq_dims: list[int]) -> list[Strategy]:
    """colwise_kv_replicated with ``n`` groups, one per kv head, for each head count ``n``
    below tp that divides it (:func:`viewed_heads`); on a Replicate input, or a
    sequence-sharded one gathered on entry as colwise's is."""
    n_out, last = module.weight.shape[0], len(y.shape) - 1
    out = []
    for n in heads:
        if n_out % n:
            continue
        grads = tuple((int(p.numel() * p.element_size() // n), tp // n) for p in module.parameters(recurse=False))
        common = dict(param_bytes=pbytes / n, flops=flops / n, act_bytes=y.nbytes / n, group_grads=grads)
        # the same kv head from rows split 1/tp: each of its tp / n ranks computes a slice of
        # it, gathered across them; backward, their partial output gradients (each rank's
        # own query heads) are summed and scattered back by a reduce-scatter, so the weight
        # gradient is complete
        g, head = tp // n, y.nbytes / n
        gathered = dict(param_bytes=pbytes / tp, flops=flops / tp, act_bytes=head,
                        group_comms=(("forward", "all_gather", head, g), ("backward", "reduce_scatter", head, g)))
        for p in ["R"] + [f"S{d}" for d in seq_dims]:
            layouts = {"weight": grouped(0, n), "groups": n, **({"input": p} if p != "R" else {})}
            out.append(Strategy("colwise_kv_replicated", (p,), grouped(last, n), entry=(p,), layouts=layouts, **common))
            if n_out % tp == 0:
                out.append(Strategy("colwise_kv_gathered", (p,), grouped(last, n), entry=(p,),
                                    layouts={**layouts, "weight": "S0"}, **gathered))
    return out
