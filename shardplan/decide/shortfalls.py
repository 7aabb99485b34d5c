"""Shortfalls: where a plan falls short of splitting a weight and its compute tp ways, said.

Contract
--------
``plan_warnings(graph, solution, tp, *, budget=False, kept=...)`` returns one line per
shortfall of a solved graph: a module with no style, attention run whole on every rank (and
the op and source line that forced it), a weight kept whole (and why: a tied read, the
memory budget, a size tp does not divide), an output all-gathered in every layer (and the
op, reshape or unequal cut downstream that needs it whole), parameters never called. The
advice names what blocks the split, never the module's name alone.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..analyze.graph import OpGraph, router_like
from .assemble import pattern_map, patterned, unused_modules
from .buffers import saved_buffer_warnings
from .placements import ANY, one_slice, shard_dim
from .scatter import is_gather
from .solve import Solution
from .listed import listed_whole
from .weights import read_elsewhere

__all__ = ["plan_warnings"]


def plan_warnings(graph: OpGraph, solution: Solution, tp: int, *, budget: bool = False,
                  kept: set[str] = frozenset()) -> list[str]:
    """Where the plan falls short of splitting a weight and its compute tp ways (at tp=1
    nothing is split by design, so only the tracer's notes remain). ``kept``: modules the
    local check replicated, which the caller explains itself."""
    out = list(graph.traced.notes)
    if tp == 1:
        return out
    output_values = {v for op in graph.ops if op.kind == "output" for v in op.inputs}
    pmap = pattern_map(graph)
    for op in graph.ops:
        if op.kind != "module" or op.target in kept:
            continue
        style = solution.strategies[op.index].name
        module = graph.model.get_submodule(op.target)
        name = patterned(op.target, graph, pmap)[0]
        if op.module_kind == "other" and style == "replicate" and not router_like(module):
            out.append(f"{name}: {type(module).__name__} has no tensor-parallel style; replicated")
        elif op.module_kind == "listed_heads" and style == "replicate":
            out.append(f"{name}: {listed_whole(op, graph, module, tp)}")
        elif op.module_kind == "attention" and style == "replicate":
            out.append(f"{name}: {_whole_attention(graph, op, module, tp)}")
        elif op.module_kind == "attention" and (unread := _unread_weights(graph, op)):
            out.append(f"{name}: {unread}")
        elif op.module_kind in ("linear", "conv1d", "embedding", "experts") and style == "replicate":
            shapes = [list(p.shape) for p in module.parameters(recurse=False) if p.dim() >= 2]
            sliced = (solution.strategies[op.index].output or "").startswith("S")
            why = ("kept whole, its output sliced along the sequence instead (sequence parallel)" if sliced
                   else "other code reads its weight as a tensor too (a tied head: `F.linear(x, emb.weight)`) and "
                        f"no split of it that code can run on divides evenly at tp={tp}, so it stays whole"
                   if op.target in read_elsewhere(graph)
                   else "replicated for speed within the memory budget" if budget
                   else f"no style splits it evenly at tp={tp}")
            out.append(f"{name}: weight {shapes[0] if len(shapes) == 1 else shapes} not sharded: {why}")
        elif solution.strategies[op.index].off_sequence:
            out.append(f"{name}: kept whole under sequence_parallel=True: {_off_sequence(graph, op, tp)}")
        elif style == "colwise_gather_output" and op.output not in output_values and _feeds_weights(graph, op.output):
            shared = solution.strategies[op.index].output == "Rp"
            reason = (_shared(graph, op) if shared else None) or _sliced_back(graph, solution, op) or _blocking_reshape(
                graph, op, tp) or _blocking_op(graph, op, tp) or (
                f"every op after it could take its output split tp={tp} ways, so either one of them also takes an input "
                "that stays whole (see the other warnings) or gathering here is cheaper (`shardplan explain` prices each style)"
            )
            out.append(f"{name}: output all-gathered: {reason}")
    for fqn in unused_modules(graph):
        reader = _parameter_reader(graph, fqn)
        out.append(f"{fqn}: {reader}; replicated" if reader else f"{fqn}: owns parameters but is not called in forward; replicated")
    return out + _whole_own_weights(graph, solution, pmap) + _unsplit_heads(graph, solution, tp, pmap) + \
        saved_buffer_warnings(graph, solution, tp, lambda fqn: patterned(fqn, graph, pmap))


def _whole_own_weights(graph: OpGraph, solution: Solution, pmap: Any) -> list[str]:
    """A container's own weight of two or more dims that its code reads as a tensor and the
    plan keeps whole (a bank of experts ``[E, D, F]`` in ``einsum`` or ``bmm``, attention
    weights in ``F.linear(x, self.wq)``): no style splits what is not a module's call, so it is
    replicated; said with the op and line, so that by-default sharding is not silently missed."""
    from ..analyze.trace import _user_line, is_weight_leaf

    out = []
    for op in graph.ops:
        param = graph.model.get_parameter(op.target) if op.kind == "const" and _is_parameter(graph, op.target) else None
        owner_module = graph.model.get_submodule(op.target.rpartition(".")[0]) if param is not None else None
        if owner_module is not None and is_weight_leaf(owner_module):
            continue  # a weight module's weight read elsewhere (a tied head) is said with the module
        if param is None or param.dim() < 2 or (solution.strategies[op.index].output or "R") != "R" \
                or not _as_weight(graph, op.output):
            continue  # a position table or a class token added to activations is kept whole as any tool keeps it
        user = next((graph.ops[c] for c in graph.consumers.get(op.output, [])), None)
        owner, _, name = op.target.rpartition(".")
        where = f" ({_user_line(user.node)})" if user is not None and _user_line(user.node) else ""
        read = f"read as a tensor by `{user.target}`{where}" if user is not None else "read as a tensor"
        out.append(f"{patterned(owner, graph, pmap)[0] if owner else type(graph.model).__name__}.{name}: weight "
                   f"{list(param.shape)} not sharded: {read} in its module's own code, which no style splits; replicated")
    return sorted(set(out))


_MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "einsum", "__matmul__", "matmul_", "baddbmm", "addmm"})
_ON_THE_WAY = frozenset({"getitem", "t", "transpose", "permute", "to", "type_as", "contiguous", "view", "reshape"})


def _as_weight(graph: OpGraph, value: int, depth: int = 2) -> bool:
    """``value`` reaches a matrix product, itself or by an index or transpose of it (``self.w1[e]``)."""
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        if user.target in _MATMULS or (depth and user.target in _ON_THE_WAY and user.output is not None
                                       and _as_weight(graph, user.output, depth - 1)):
            return True
    return False


def _is_parameter(graph: OpGraph, target: str) -> bool:
    try:
        graph.model.get_parameter(target)
    except AttributeError:
        return False
    return True


def _unsplit_heads(graph: OpGraph, solution: Solution, tp: int, pmap: Any) -> list[str]:
    """Attention that runs whole on every rank though no projection before it was gathered
    (q/k/v ``rowwise`` after a feature-split embedding: the weights split, the heads not),
    which no gathered-output warning reveals: said at the attention, with what blocks a
    split by heads."""
    from ..analyze.trace import _user_line

    out = []
    for op in graph.ops:
        if op.target != "scaled_dot_product_attention" or shard_dim(solution.placements.get(op.output, "R")) is not None:
            continue
        source = _producer_module(graph, op.inputs[0])
        if source is None or solution.strategies[source.index].name == "colwise_gather_output":
            continue  # no projection, or its gather is said already
        why = _whole_mask(graph, solution, op) or (
            _blocking_op(graph, source, tp) if source.module_kind in ("linear", "conv1d") else "")
        out.append(f"{patterned(op.owner, graph, pmap)[0]}: attention runs whole on every rank: "
                   f"`scaled_dot_product_attention` ({_user_line(op.node)}) takes its query whole, "
                   f"{patterned(source.target, graph, pmap)[0]} being {solution.strategies[source.index].name}"
                   + (f": {why}" if why else ""))
    return out


_REPEATS = _ON_THE_WAY | {"expand", "unsqueeze", "repeat_interleave", "repeat", "squeeze", "flatten"}


def _whole_mask(graph: OpGraph, solution: Solution, op) -> str:
    """The mask of an attention, when it holds a row per head and stays whole: q, k and v
    then stay whole to match it (Doge's dynamic mask, computed from all kv heads' values
    by a Linear over them), whatever their projections could take."""
    from ..analyze.trace import _user_line

    if len(op.inputs) < 4:
        return ""
    q, mask = graph.values[op.inputs[0]].shape, graph.values[op.inputs[3]].shape
    if len(q) != 4 or len(mask) != 4 or mask[1] != q[1] or q[1] == 1 or solution.placements.get(op.inputs[3], "R") != "R":
        return ""
    maker = graph.ops[graph.values[op.inputs[3]].producer]
    while maker.kind == "function" and maker.inputs and maker.target in _REPEATS:  # repeat_kv's helper: not where it is made
        maker = graph.ops[graph.values[maker.inputs[0]].producer]
    where = _user_line(maker.node) if maker.node is not None else ""
    return (f"its mask holds a row per head ({list(mask)}, made by `{maker.target}`"
            + (f" at {where}" if where else "") + ") and is computed whole, so the heads stay whole to match it")


def _producer_module(graph: OpGraph, value: int, depth: int = 12):
    """The weight module whose output ``value`` is, through the ops that reshape it."""
    for _ in range(depth):
        op = graph.ops[graph.values[value].producer]
        if op.kind == "module":
            return op
        if op.kind != "function" or not op.inputs:
            return None
        value = op.inputs[0]
    return None


# a gathered output placed ``Rp``: one value every rank's heads read whole (a single kv head,
# MLA's shared key), as Megatron and vLLM keep it; its gradient is summed by the reduce-scatter
_SHARED = ("every rank's heads read it whole (one kv head, or a key all heads share), so each rank holds it all, "
           "as Megatron does; backward sums its gradient with one reduce-scatter")


_ROUTING = frozenset({"topk", "argmax", "sort", "argsort"})


def _shared(graph: OpGraph, op) -> str:
    """Why a gathered output is read whole by every rank: a router's scores, which every
    rank's routing reads (Mixtral's ``topk(gate(x))``), or shared kv heads."""
    values = [op.output]
    for _ in range(4):  # the scores' softmax or cast before the routing op
        users = [graph.ops[c] for v in values for c in graph.consumers.get(v, [])]
        if any(u.target in _ROUTING for u in users):
            return ("a router's scores, which every rank's routing reads whole, so each rank holds them all; backward "
                    "sums their gradient with one reduce-scatter")
        values = [u.output for u in users if u.output is not None]
    return _SHARED


def _sliced_back(graph: OpGraph, solution: Solution, op) -> str:
    """A gathered projection whose only reader is a norm over all its features, run whole and
    its output sliced back to each rank's share (OLMo 2's q_norm): said as such."""
    from ..analyze.trace import _user_line

    readers = [graph.ops[c] for c in graph.consumers.get(op.output, [])]
    if not readers or any(u.module_kind != "norm" or not (solution.strategies[u.index].output or "").startswith("S")
                          for u in readers):
        return ""
    where = _user_line(readers[0].node)
    return (f"module `{readers[0].target}`" + (f" ({where})" if where else "") + " normalizes all its features "
            "together, so it runs on the gathered tensor and hands each rank its slice of the result")


def _feeds_weights(graph: OpGraph, value: int) -> bool:
    """Whether a weight module reads ``value`` or anything computed from it: a head whose
    logits are only scaled or cast on the way out (cohere's ``* logit_scale``, granite's
    ``/ logits_scaling``) is gathered at the model's end, not mid-model."""
    frontier, seen = [value], set()
    while frontier:
        v = frontier.pop()
        for c in graph.consumers.get(v, []):
            user = graph.ops[c]
            if user.kind in ("module", "folded"):
                return True
            if c not in seen and user.output is not None:
                seen.add(c)
                frontier.append(user.output)
    return False


def _whole_attention(graph: OpGraph, op, module: nn.Module, tp: int) -> str:
    """Why an ``nn.MultiheadAttention`` runs whole, with the call's source line."""
    from ..analyze.trace import _user_line
    from .attention import attention_call

    where = _user_line(op.node)
    at = f" ({where})" if where else ""
    if module.num_heads % tp:
        return f"its {module.num_heads} heads do not divide by tp={tp}, so the attention runs whole; use a tp that divides them"
    if graph.traced.front_end == "export":
        return ("traced by torch.export, whose graph does not keep the call's arguments, so the attention runs whole "
                "(the meta fx tracer keeps them: make the rest of the model traceable by it)")
    call = attention_call(op, graph)
    if call.need_weights and not call.splittable:
        return (f"the call{at} asks for per-head attention weights (average_attn_weights=False), which would need every "
                "head on every rank, so the attention runs whole; average them or pass need_weights=False")
    return f"kept whole by the cost model (`shardplan explain` prices each style){at}"


def _unread_weights(graph: OpGraph, op) -> str:
    """The call returns averaged attention weights (``need_weights`` defaults to True) that
    nothing reads: split by heads, each call still sums them across ranks."""
    from ..analyze.trace import _user_line
    from .attention import attention_call

    call = attention_call(op, graph)
    readers = [graph.ops[c] for c in graph.consumers.get(op.output, [])]
    if not call.need_weights or not all(u.target == "getitem" and u.node.args[1:2] == (0,) for u in readers):
        return ""
    where = _user_line(op.node)
    return (f"the call{f' ({where})' if where else ''} returns attention weights (need_weights defaults to True) that "
            f"nothing reads, and each call all-reduces them ({call.batch}x{call.tgt_len}x{call.src_len}); "
            "pass need_weights=False")


def _parameter_reader(graph: OpGraph, fqn: str) -> str | None:
    """What uses ``fqn``'s parameters without calling it as a weight module, with the source
    line: an op reading one as a tensor; None if nothing does."""
    from ..analyze.trace import _user_line

    for op in graph.ops:
        if op.kind == "const" and op.target.rpartition(".")[0] == fqn and op.output is not None:
            user = next((graph.ops[c] for c in graph.consumers.get(op.output, [])), None)
            if user is not None:
                where = _user_line(user.node)
                return (f"its parameters are read as plain tensors by `{user.target}`" + (f" ({where})" if where else "")
                        + ", not through a call of it, so no style applies")
    return None


def _blocking_reshape(graph: OpGraph, op, tp: int) -> str:
    """The reshape downstream of ``op`` that splits its features into groups tp does not
    divide (7 heads at tp=2), named with the numbers and the source line; "" if none. The
    split dim is followed through the views that keep it (``[.., 2048] -> [.., 16, 128]``
    moves it to the heads) and through ops that keep the rank; a view that merges the
    heads back (``[.., 16, 128] -> [.., 2048]``) keeps a split of the heads, so it is not
    the one to blame."""
    from .strategies import VIEWS, _map_view_dim
    from ..analyze.trace import _user_line

    frontier, seen = [(op.output, len(graph.values[op.output].shape) - 1)], set()
    for _ in range(4):  # a few ops deep: activation, view, transpose
        nxt = []
        for value, d in frontier:
            for c in graph.consumers.get(value, []):
                user = graph.ops[c]
                if user.kind != "function" or user.output is None or c in seen or d < 0:
                    continue
                seen.add(c)
                src, dst = graph.values[value].shape, graph.values[user.output].shape
                if user.target in VIEWS and src and src[d] % tp == 0:
                    moved = _map_view_dim(src, dst, d, tp)
                    if moved is None:
                        return _reshape_message(src, dst, d, tp, _user_line(user.node))
                    nxt.append((user.output, moved))
                elif user.target not in VIEWS:  # a split or slice of the last dim keeps the heads' dim
                    nxt.append((user.output, d if len(dst) == len(src) else len(dst) - 1))
        frontier = nxt
    return ""


def _reshape_message(src: tuple[int, ...], dst: tuple[int, ...], d: int, tp: int, where: str) -> str:
    """Why a reshape cannot keep a split of src dim ``d``: its groups (heads) are not a
    multiple of tp, or the heads merge with a dim before them (fairseq's ``bsz * num_heads``,
    [s, b, h*d] -> [s, b*h, d]), where a shard of the merged dim would be a shard of the
    batch, not of the heads."""
    from .placements import view_groups

    at = f" ({where})" if where else ""
    merged = next((gi for gi, _ in view_groups(tuple(src), tuple(dst)) if d in gi), [d])
    before = [k for k in merged if k < d and src[k] != 1]
    into = next((gj for gi, gj in view_groups(tuple(src), tuple(dst)) if d in gi), [])
    if before and all(dst[k] == 1 for k in into[1:]):  # no dim after the merged one: not heads
        return (f"reshape {list(src)} -> {list(dst)} turns its {src[d]} features into rows of dim {before[0]} "
                f"(size {src[before[0]]}){at}: one value per row, so no split of the features survives it; "
                "it reads them whole")
    if before:
        return (f"reshape {list(src)} -> {list(dst)} merges its {src[d]} features with dim {before[0]} (size "
                f"{src[before[0]]}) before them{at}: a split of the merged dim would split dim {before[0]}, not the "
                "heads; keep the heads a dim of their own (view(s, b, num_heads, head_dim))")
    groups = _outer_group(src, dst, d)
    return (f"reshape {list(src)} -> {list(dst)} makes {groups} groups (heads) of its {src[d]} features, which "
            f"tp={tp} does not divide{at}; use a tp that divides {groups}")


def _outer_group(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int:
    """The outermost size src dim ``d`` is cut into by a reshape: [.., 768] -> [.., 12, 64]
    makes 12 groups (heads), whatever dims before it were added or merged."""
    from .placements import view_groups

    for gi, gj in view_groups(tuple(src), tuple(dst)):
        if d in gi:
            return next((dst[k] for k in gj if dst[k] != 1), dst[-1])
    return dst[-1]


def _blocking_op(graph: OpGraph, op, tp: int, *, depth: int = 24, placement: str | None = None) -> str:
    """The first op downstream of ``op``'s output, split on its last dim as ``colwise`` leaves
    it, that has no strategy taking that split (it needs the whole tensor there), followed
    through every op that keeps a split; named with its source line. "" when every path
    reaches a weight module or the end with the split intact, i.e. the gather was a choice."""
    from .strategies import op_strategies

    last = len(graph.values[op.output].shape) - 1
    frontier, seen = [(op.output, placement or f"S{last}")], set()
    for _ in range(depth):
        nxt = []
        for value, placement in frontier:
            for c in graph.consumers.get(value, []):
                if (c, value, placement) in seen:
                    continue
                seen.add((c, value, placement))
                user = graph.ops[c]
                outs = _outputs_taking(user, value, placement, op_strategies(user, graph, tp=tp))
                if outs is None:
                    return _blocked_by(user, graph.values[value].shape, shard_dim(placement), tp, graph=graph, value=value)
                if user.kind == "function" and user.output is not None:
                    nxt += [(user.output, o) for o in outs if o.startswith("S")]
        frontier = nxt
    return ""


def _off_sequence(graph: OpGraph, op, tp: int) -> str:
    """Why a norm that could run on sequence shards is kept whole: the op that makes its
    input cannot hand it on split along the sequence (a Linear between two norms, a flatten
    of batch and sequence), or an op after it cannot take the split (a gate that scales a
    partial sum); named with its source line."""
    from ..analyze.trace import _user_line
    from .strategies import op_strategies

    split = next(s.inputs[0] for s in op_strategies(op, graph, tp=tp) if s.name != "replicate")
    producer = graph.ops[graph.values[op.inputs[0]].producer]
    if producer.kind != "input" and not any(s.output == split for s in op_strategies(producer, graph, tp=tp)):
        where = _user_line(producer.node)
        what = f"module `{producer.target}`" if producer.kind == "module" else f"`{producer.target}`"
        return (f"{what}{f' ({where})' if where else ''} cannot hand on its output split along the sequence, "
                "so the norm reads it whole")
    blocker = _blocking_op(graph, op, tp, placement=split)
    return blocker or ("no plan hands it its input split along the sequence with the code around it "
                       "(`shardplan explain` prices each style)")


def _blocked_by(user, shape, dim: int, tp: int, *, graph: OpGraph, value: int) -> str:
    from ..analyze.trace import _user_line

    where = _user_line(user.node)
    what = (f"`{user.target}`" if user.kind != "module" else f"module `{user.target}`") + (f" ({where})" if where else "")
    if shape[dim] % tp:  # nothing could run on an uneven split: say that, not the op's fault
        return f"its {shape[dim]} output features do not divide by tp={tp}, so {what} and everything after it run on them whole"
    parts = _unequal_parts(graph, value, dim)
    if parts:
        hint = ("; a fused q/k/v splits when written as separate Linears, or with its rows ordered per kv head "
                "(view(b, s, kv, q_per_kv + 2, head_dim))") if parts[1] == 3 else ""
        # planned packed by parts (PackedShard) when each part keeps whole heads on a rank, and
        # with kv parts of fewer heads than ranks gathered where read (decide/tails.py): the
        # query part must still split into whole heads
        return (f"{what} cuts its {shape[dim]} features into {parts[0]}: unequal parts split by heads when "
                f"tp={tp} divides the first part's (query) heads and every part's rows (k and v of fewer heads than "
                f"ranks gathered where they are read), and the code's sizes can be made local; here they run whole: "
                f"plan for a tp that divides the query heads, or see the warning naming a size the code reads{hint}")
    return f"{what} needs its input whole where tp={tp} splits it (dim {dim}), and everything after it runs on the gathered tensor"


def _unequal_parts(graph: OpGraph, value: int, dim: int) -> tuple[str, int] | None:
    """How the consumers of ``value`` cut ``dim`` into parts of unequal widths (GQA fused
    q/k/v: ``split([q, kv, kv])``, or slices ``[:q]``, ``[q:q + kv]``, ``[q + kv:]``), and
    into how many; None when they do not."""
    shape = graph.values[value].shape
    slices = []
    for c in graph.consumers.get(value, []):
        user = graph.ops[c]
        args = user.node.args
        if user.target == "split" and len(args) > 1 and isinstance(args[1], (list, tuple)):
            at = user.node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if isinstance(at, int) and at % len(shape) == dim and len(set(args[1])) > 1:
                return f"unequal parts {list(args[1])}", len(args[1])
        cut = one_slice(args[1]) if user.target == "getitem" and len(args) > 1 else None
        if cut is not None and (args[1] if isinstance(args[1], tuple) else (args[1],))[-1] is cut:
            slices.append(cut.indices(shape[dim])[:2])
    if len({stop - start for start, stop in slices}) < 2:
        return None
    return "slices " + ", ".join(f"[{start}:{stop}]" for start, stop in sorted(slices)), len(slices)


def _outputs_taking(user, value: int, placement: str, strategies) -> set[str] | None:
    """The output placements of ``user``'s strategies that take ``value`` as ``placement``
    (at every position it is passed), or None if no strategy does."""
    positions = [i for i, v in enumerate(user.inputs) if v == value]
    # a strategy that gathers the split where it reads it (a norm over all features) needs it whole
    fits = [s for s in strategies if all(i < len(s.inputs) and s.inputs[i] in (placement, ANY)
                                         and not is_gather(s.entry[i] if i < len(s.entry) else None) for i in positions)]
    return {s.output or "R" for s in fits} if fits else None
