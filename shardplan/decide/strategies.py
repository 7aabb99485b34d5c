"""Strategies: for each op, the input/output placements under which it runs shard-locally.

Contract
--------
``op_strategies(op, graph, tp=...)`` lists the :class:`Strategy` objects an op may take on
a tensor-parallel axis of size ``tp``. A placement is ``"R"`` (Replicate), ``"P"``
(Partial: each rank holds a summand) or ``"S{d}"`` (Shard(d), ``d`` >= 0).

Between weight modules the activations are plain local tensors (``use_local_output``), so
an op is valid under a strategy only if running it on the local shards gives the local
shard of the global result: elementwise ops on equally sharded operands, views that keep
the sharded dim outermost in its group, attention on sharded heads, reductions over other
dims. The hand rules below cover what DTensor cannot say (Partial through linear ops,
packed layouts, views DTensor would redistribute); every other op takes the strategies
DTensor's own sharding propagation gives it (:mod:`.propagation`), and the all-Replicate
strategy, which is always valid.

Weight modules carry the collectives their style implies (``fwd``/``bwd``), and ``entry``
marks inputs whose redistribution is shared by every consumer of the value when the
emitter wraps the consumers in one ``PrepareModuleInput`` region:

* ``entry="R"``: colwise consumes a Replicate activation; the gradient that comes back is
  Partial (dy is sharded on the output features, W on rows: dx = dy @ W sums over the
  shard), so backward needs one all-reduce per value, not per Linear.
* ``entry="S{d}"``: a sequence-sharded activation is all-gathered on entry (forward
  all-gather) and its Partial gradient reduce-scattered back (backward reduce-scatter).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from ..analyze.graph import LIKE_OPS, Op, OpGraph, grad_inputs

from .buffers import buffer_strategies, written_buffers
from .folded import folded_factory_strategies, folded_values, folded_variants, folded_view_strategies, rank_order_twins
from .tied import tied_product_twins, weight_read_elsewhere
from .heads import grouped_conversions, grouped_values, grouped_variants, grouped_writes, partial_grad_twins, under_partial_grad_owner
from .placements import (
    ANY, VIEW_OPS, Strategy, chunk_count, expanded_dims, groups_of, index_items, local_shape, narrow_index, packed, permutation,
    placement_str, shard_dim, tail_of,
    sliced_part,
    split_parts, split_widths, view_groups, view_parts,
)
from .propagation import dtensor_strategies, in_place_strategies, metadata_only
from .scatter import cut_twins, exits, gather_twins, is_cut, scatter_twins, sum_twins
from .slices import inner_cut_twins, is_slice, slice_twins
from .tails import tail_strategies
from .packing import packed_chains, slice_partition
from .weights import module_strategies

__all__ = ["Strategy", "op_strategies", "shard_dim", "placement_str", "packed", "chunk_count", "param_only_values"]

def _candidates(shape: tuple[int, ...], tp: int) -> list[str]:
    return ["R"] + [f"S{d}" for d, n in enumerate(shape) if n % tp == 0 and n >= tp]


def _shape(graph: OpGraph, value: int) -> tuple[int, ...]:
    return graph.values[value].shape


def _all(op: Op, p: str, out: str | None = None, **kw: Any) -> Strategy:
    return Strategy("", tuple(p for _ in op.inputs), out if out is not None else p, **kw)


UNARY = {
    "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos",
    "dropout", "softplus", "erf", "square", "reciprocal", "relu_", "gelu_", "pow", "clamp", "clamp_min",
    "leaky_relu", "elu", "mish", "hardtanh", "silu_", "triu", "tril", "fill_", "masked_fill", "__invert__",
    "logical_not", "softsign", "log1p", "expm1", "sign", "round", "floor", "ceil", "nan_to_num", "bool", "long", "int",
}
LINEAR_UNARY = {"neg", "contiguous", "clone", "float", "half", "bfloat16", "double", "to", "type_as", "type", "detach", "identity"}
ADDITIVE = {"add", "sub", "iadd", "isub", "__add__", "__sub__", "__radd__", "__rsub__", "rsub", "add_", "sub_"}
MULTIPLICATIVE = {"mul", "truediv", "div", "imul", "itruediv", "__mul__", "__truediv__", "__rmul__", "mul_", "div_"}
BROADCAST = {"where", "maximum", "minimum", "pow", "eq", "ne", "lt", "gt", "le", "ge", "and_", "or_", "floordiv", "lerp"}
# ops whose every output entry reads its own input entry only (not its position: triu, tril)
_PER_ENTRY = (UNARY | LINEAR_UNARY) - {"triu", "tril"}
# a MoE written by hand sums its experts' partial sums into zeros at the routed rows
# (``out = zeros_like(x); out.index_add_(0, rows, expert(x[rows]) * w)``): zeros on every rank
# are a partial sum of zeros, and adding rows at whole indices is linear in both operands
ZEROS = {"zeros_like", "new_zeros"}
ADD_AT = {"index_add", "index_add_", "scatter_add", "scatter_add_"}
VIEWS = VIEW_OPS
PERMUTES = {"transpose", "permute", "t", "movedim", "swapaxes", "swapdims"}
REDUCE_SUM = {"sum"}
REDUCE_OTHER = {"softmax", "log_softmax", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "argmax", "argmin", "cumsum", "logsumexp", "any", "all", "prod"}
MATMUL = {"matmul", "bmm", "mm", "__matmul__"}


def op_strategies(op: Op, graph: OpGraph, *, tp: int, opts: Any = None) -> list[Strategy]:
    """All strategies of ``op``; see the module docstring."""

    if op.kind == "const" and op.output is not None and _container_param(graph, op.target) is not None:
        return _container_param_strategies(op, graph, tp)
    if op.kind == "const" and op.output is not None and weight_read_elsewhere(graph, op) is not None:
        return [Strategy("", (), p, layouts={"weight": p}) for p in _candidates(_shape(graph, op.output), tp)]
    if op.kind == "const" and op.index in written_buffers(graph):
        return buffer_strategies(op, graph, tp, groups=op.output in grouped_values(graph, tp),
                                 partial=under_partial_grad_owner(op.owner, graph, tp))
    if op.kind in ("input", "const"):
        return [Strategy("", (), "R")]
    if op.kind == "output":
        return _output_strategies(op, graph, tp, opts)
    if op.kind == "module":
        found = module_strategies(op, graph, tp=tp, opts=opts)
        if getattr(opts, "sequence_parallel", None) is not False:
            # a router reading the tokens before they are flattened; a norm after a MoE block
            found += gather_twins(op, graph, found, tp) + scatter_twins(op, graph, found) + cut_twins(op, graph, found)
            found += slice_twins(op, graph, found, returned=exits(graph))  # the first block's norm, cutting the stream
        return found
    if op.kind == "folded":  # placements are tied to the representative block by the solver
        return [Strategy("folded", tuple(ANY for _ in op.inputs), None)]
    if op.output is None:
        if op.target == "getitem" and op.node.op == "call_function":
            # an element of a module's tuple that is not a tensor: nn.MultiheadAttention's
            # weights with need_weights=False, ``a, _ = self.attn(h, h, h)``
            return [Strategy("", (ANY,) * len(op.inputs), None)]
        if metadata_only(op):  # x.device, x.dtype: the same answer from any shard
            if len(op.inputs) != 1:
                return [_all(op, "R", None)]
            folded = [packed(d, k) for k in sorted(folded_values(graph, tp).get(op.inputs[0], ()))
                      for d, n in enumerate(_shape(graph, op.inputs[0])) if n % (k * tp) == 0]
            return [Strategy("", (p,), None) for p in _candidates(_shape(graph, op.inputs[0]), tp) + folded]
        # a write into a sharded tensor (t[:, :, i] = v) stays on each rank's shard
        written = [_all(op, "R", None)] + [Strategy("", ins, None) for ins in in_place_strategies(op, graph, tp=tp)]
        if any(v in grouped_values(graph, tp) for v in op.inputs):
            written += grouped_writes(op, graph, tp)
        if op.inputs and op.inputs[0] in graph.requires_grad and under_partial_grad_owner(op.owner, graph, tp):
            # MQA's one kv head (``Rp``) written into a whole cache, read back ``Rp``
            written.append(Strategy("", tuple("Rp" if v in graph.requires_grad else "R" for v in op.inputs), None))
        return written + _partial_sums(op)
    return _function_strategies(op, graph, tp, opts)


def _container_param(graph: OpGraph, target: str) -> Any:
    """The trainable parameter a container reads in its own forward (gpt-oss's per-head
    attention ``sinks``), or None: a weight module's parameter follows that module's style."""
    from ..analyze.trace import is_weight_leaf

    owner, _, name = target.rpartition(".")
    try:
        mod = graph.model.get_submodule(owner)
    except AttributeError:
        return None
    p = mod._parameters.get(name)
    return p if p is not None and p.requires_grad and not is_weight_leaf(mod) else None


def _container_param_strategies(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """Whole, or split on a dim tp divides (a per-head parameter beside heads split tp ways:
    each rank keeps its heads' entries, and their gradients are local, so nothing is reduced)."""
    shape = _shape(graph, op.output)
    return [Strategy("", (), p, layouts={"weight": p}) for p in _candidates(shape, tp)]


def _output_strategies(op: Op, graph: OpGraph, tp: int, opts: Any) -> list[Strategy]:
    """The user gets whole tensors back; with ``loss_parallel`` the logits may stay sharded
    on the vocabulary (Shard(-1)) for ``torch.distributed.tensor.parallel.loss_parallel``."""
    if not op.inputs:
        return [Strategy("", (), None)]
    out = [_all(op, "R", "R")]
    if getattr(opts, "loss_parallel", False) and len(op.inputs) == 1:
        shape = _shape(graph, op.inputs[0])
        if len(shape) >= 2 and shape[-1] % tp == 0:
            out.append(Strategy("", (f"S{len(shape) - 1}",), "R"))
    return out


def _function_strategies(op: Op, graph: OpGraph, tp: int, opts: Any = None) -> list[Strategy]:
    name = op.target
    if name in ("max", "min") and len(op.inputs) == 2:  # torch.max(a, b): elementwise, not a reduction
        name = {"max": "maximum", "min": "minimum"}[name]
    out_shape = _shape(graph, op.output)
    mem = graph.values[op.output].nbytes + sum(graph.values[v].nbytes for v in op.inputs)
    rules = [
        (UNARY | LINEAR_UNARY, _unary),
        (ADDITIVE | MULTIPLICATIVE | BROADCAST, _broadcast),
        (VIEWS, _view),
        (PERMUTES, _permute),
        (REDUCE_SUM | REDUCE_OTHER, _reduce),
        (MATMUL, _matmul),
        ({"scaled_dot_product_attention"}, _sdpa),
        ({"cat", "concat", "stack"}, _cat),
        ({"chunk", "split", "unbind", "tensor_split"}, _split),
        ({"getitem"}, _getitem),
        ({"narrow"}, _narrow),
        ({"expand", "expand_as"}, _expand),
        ({"new_empty", "new_zeros", "new_ones", "new_full"}, _new_tensor),
    ]
    grouped_in = any(v in grouped_values(graph, tp) for v in op.inputs)
    strategies = [_all(op, "R")] + _partial_sums(op)
    for names, rule in rules:
        if name in names or (op.node.op == "call_module" and name in names):
            strategies += rule(op, graph, tp, out_shape)
            if rule in _SHARD_LOCAL and grouped_in:
                strategies += grouped_variants(op, graph, tp, out_shape, rule)
            break
    else:
        if op.node.op == "call_module" and _param_free_elementwise(op, graph):
            strategies += _unary(op, graph, tp, out_shape)
        else:  # no hand rule: ask DTensor's sharding propagation (checked on local shapes)
            strategies += [Strategy("", ins, out) for ins, out in dtensor_strategies(op, graph, tp=tp)]
            strategies += _group_norm(op, graph, tp)
            if grouped_in:  # on kv heads in groups too (RoPE's view_as_complex of a grouped k)
                strategies += grouped_variants(op, graph, tp, out_shape, _propagated)
    if name in VIEWS:  # heads folded into the batch (fairseq's bmm attention) and back
        strategies += folded_view_strategies(op, graph, tp)
    elif not op.inputs or name == "expand":
        strategies += folded_factory_strategies(op, graph, tp, out_shape)
    elif any(v in folded_values(graph, tp) for v in op.inputs):
        strategies += folded_variants(op, graph, tp, strategies, lambda v: _shape(graph, v), out_shape)
        if name in _PER_ENTRY or (op.node.op == "call_module" and _param_free_elementwise(op, graph)):
            strategies += rank_order_twins(op, graph, tp, strategies)  # OPT's activation between fc1 and fc2
    if grouped_in:
        strategies += grouped_conversions(op, graph, tp, out_shape)
    if name in VIEWS or name in PERMUTES or name in ("split", "getitem"):  # kv heads cut off a fused projection
        strategies += tail_strategies(op, graph, tp, out_shape)
    if under_partial_grad_owner(op.owner, graph, tp):
        strategies += partial_grad_twins(op, graph, tp, strategies, out_shape)
    # a whole bias, or the stream the first block receives, cut where its module receives it
    strategies += slice_twins(op, graph, strategies, sequence=getattr(opts, "sequence_parallel", None) is not False,
                              returned=exits(graph))
    chained = packed_chains(graph, tp).get(op.index)
    if chained:  # an elementwise op between a packed projection and its cut (OLMo's clamp_ of qkv)
        last = len(out_shape) - 1
        strategies.append(Strategy("", (packed(last, chained),), packed(last, chained)))
    if tp > 1:  # a whole bias its module makes, cut where it is read
        strategies += inner_cut_twins(op, graph, strategies)
    strategies += sum_twins(op, graph, strategies)  # a partial sum all-reduced where its module returns
    if getattr(opts, "sequence_parallel", None) is not False:
        strategies += scatter_twins(op, graph, strategies)  # a partial sum reduce-scattered where its module returns
        strategies += cut_twins(op, graph, strategies)  # a whole value cut where its module returns
        strategies += gather_twins(op, graph, strategies, tp)  # a sequence shard gathered where its module receives it
    # a tied head's vocabulary rows, its logits gathered; its whole input is a region's entry,
    # whose gradient that entry sums (so no partial gradient is left behind)
    tied = {id(s): s for s in tied_product_twins(op, graph, strategies)}
    strategies += tied.values()
    seen: set[tuple] = set()
    result = []
    flops = _sdpa_flops(op, graph) if name == "scaled_dot_product_attention" else 0.0
    for s in strategies:
        key = (s.inputs, s.output, s.entry)
        if key not in seen and len(s.inputs) == len(op.inputs) and (id(s) in tied or not _partial_gradient(op, graph, s)):
            seen.add(key)
            factor = _share(s.output, out_shape, tp)
            result.append(Strategy(s.name, s.inputs, s.output, fwd=s.fwd if id(s) in tied else (), entry=s.entry, mem_bytes=mem / factor, flops=flops / factor,
                                   act_bytes=graph.values[op.output].nbytes / factor))
    return result


def _share(p: str | None, shape: tuple[int, ...], tp: int) -> float:
    """The divisor of an op's bytes and flops per rank: 1 whole, the group count kv-grouped,
    whole value over local piece for a whole tail (its tail is on every rank), else tp."""
    if p in ("R", "Rp"):
        return 1
    if tail_of(p) and shape:
        return math.prod(shape) / math.prod(local_shape(shape, p, tp))
    return (groups_of(p) or ("", tp))[1] if "g" in (p or "") else tp


def _partial_gradient(op: Op, graph: OpGraph, s: Strategy) -> bool:
    """A whole (``R``) operand that needs a gradient, broadcast into a computation split tp
    ways (a gate ``[b, s, 1]`` times a sharded activation): its gradient on each rank is the
    sum over that rank's shard only, a partial sum nothing between weight modules would
    all-reduce. Refused, except for values computed from a container's own parameters alone
    (a learned temperature): those gradients are all-reduced when backward ends
    (:func:`.regions.partial_grad_params`)."""
    if s.output is None or s.output == "R":
        return False
    # a whole value cut where a module before the repeated blocks returns it (a position
    # encoding's output) is read as its rank's slice, whose gradient is whole for that slice:
    # the cut's backward all-gathers the slices. Inside the blocks, the same for a module's
    # whole output shaped as the stream (a MoE of raw-parameter experts run on DTensors, its
    # tokens gathered where it receives them); a table a block's code reads sizes off is not
    # cut so. The same for the stream a block receives whole and cuts (slice_twins).
    cut = [bool(s.entry) and i < len(s.entry) and (
        (is_cut(s.entry[i]) and (_before_blocks(graph, v) or _stream_shaped(graph, v))) or is_slice(s.entry[i]))
           for i, v in enumerate(op.inputs)]
    return any(p == "R" and v in graph.requires_grad and v not in param_only_values(graph) and not cut[i]
               for i, (p, v) in enumerate(zip(s.inputs, op.inputs)))


def _before_blocks(graph: OpGraph, value: int) -> bool:
    """``value`` is returned by a module outside every repeated block (folded stacks) and
    handed as it is to the first of them: the residual stream entering the blocks, not a
    table a block's code reads sizes off."""
    exit_ = exits(graph).get(value)
    reps = set(graph.traced.folded.values())
    stacks = set(graph.traced.folded) | reps
    if exit_ is None or any(exit_.module == b or exit_.module.startswith(b + ".") for b in stacks):
        return False
    return value in _stream_values(graph)


def _stream_shaped(graph: OpGraph, value: int) -> bool:
    """``value`` has the shape of the stream the repeated blocks receive (``[b, s, h]``)."""
    return graph.values[value].shape in {graph.values[v].shape for v in _stream_values(graph)}


def _stream_values(graph: OpGraph) -> frozenset[int]:
    """The values each repeated block's representative receives first: the residual stream."""
    cached = graph.strategy_cache.get("stream values")
    if cached is None:
        cached = graph.strategy_cache["stream values"] = frozenset(
            v for rep in set(graph.traced.folded.values()) for call in graph.traced.calls.get(rep, [])[:1]
            for node in call.args[:1] if (v := getattr(node, "meta", {}).get("shardplan_op")) in graph.values)
    return cached


def param_only_values(graph: OpGraph) -> frozenset[int]:
    """Values computed from trainable container parameters alone (``self.scale.exp()``)."""
    cached = graph.strategy_cache.get("param_only")
    if cached is None:
        found: set[int] = set()
        for op in graph.ops:
            if op.output is None or op.output not in graph.requires_grad:
                continue
            sources = grad_inputs(op)
            if (op.kind == "const" and _container_param(graph, op.target) is not None) or (
                    op.kind == "function" and sources and all(
                        v in found or v not in graph.requires_grad for v in sources) and any(v in found for v in sources)):
                found.add(op.output)
        cached = graph.strategy_cache["param_only"] = frozenset(found)
    return cached


def _sdpa_flops(op: Op, graph: OpGraph) -> float:
    """Attention's two batched matmuls, q [b, h, sq, d] k^T and p v [b, h, sk, dv], forward and
    backward (:func:`.cost.attention_flops`); a split on heads or batch divides them by tp."""
    from .cost import attention_flops

    shapes = [_shape(graph, v) for v in op.inputs[:3]]
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes):
        return 0.0
    (b, h, sq, d), (_, _, sk, _), (_, _, _, dv) = shapes
    return attention_flops(batch=b, heads=h, seq_q=sq, seq_k=sk, head_dim=d, value_dim=dv)


# where activation and dropout modules are defined: each acts entry by entry. Any other
# parameter-free module of the same shape in and out may mix entries (RWKV's ``ZeroPad2d``
# token shift moves each token to the next position): DTensor's propagation answers for it
_ELEMENTWISE_MODULES = ("torch.nn.modules.activation", "torch.nn.modules.dropout", "transformers.activations")


# activation modules that normalize along a dim (each output reads the whole dim): not elementwise
_ROW_MIXING = (torch.nn.Softmax, torch.nn.Softmin, torch.nn.LogSoftmax, torch.nn.Softmax2d)


def _param_free_elementwise(op: Op, graph: OpGraph) -> bool:
    """Activation/dropout modules: same shape in and out, one tensor input."""
    cls = type(graph.model.get_submodule(op.node.target))
    known = (cls.__module__ in _ELEMENTWISE_MODULES and not issubclass(cls, _ROW_MIXING)) or cls is torch.nn.Identity
    return known and len(op.inputs) == 1 and _shape(graph, op.inputs[0]) == _shape(graph, op.output)


def _group_norm(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """A group norm normalizes each group of channels (dim 1) over its own channels and
    positions, so a rank holding whole groups (tp divides the groups; channels split in
    contiguous blocks hold whole groups) normalizes them alone, told the local group count
    (its module's ``num_groups``: :func:`.assemble.group_norm_attributes`).
    RetNet's norm over heads: ``GroupNorm(heads, heads * head_dim)`` on
    ``[b * t, heads * head_dim]`` after attention split by heads. Without weights only (an
    affine one is a weight module)."""
    if len(op.inputs) != 1 or op.node.op != "call_module":
        return []  # ``F.group_norm(x, self.heads)``: no attribute of its own to make local
    module = graph.model.get_submodule(op.node.target)
    groups = module.num_groups if isinstance(module, torch.nn.GroupNorm) and not module.affine else None
    shape = _shape(graph, op.inputs[0])
    if not isinstance(groups, int) or len(shape) < 2 or groups % tp or shape[1] % groups:
        return []
    return [Strategy("", ("S1",), "S1")]


def _unary(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    if len(op.inputs) == 2 and op.target in LIKE_OPS and _shape(graph, op.inputs[0]) == out_shape:
        # the second tensor is read for its dtype and device, which no placement changes: it
        # may come split or whole (``mask.to(q)`` with q split by heads)
        return [Strategy("", (p, ANY), p) for p in _candidates(out_shape, tp) if p != "R"] + [
            Strategy("", ("P", ANY), "P"), Strategy("", ("R", ANY), "R")]
    if len(op.inputs) != 1:
        return _broadcast(op, graph, tp, out_shape)
    if _shape(graph, op.inputs[0]) != out_shape:
        return []
    out = [_all(op, p) for p in _candidates(out_shape, tp) if p != "R"]
    if op.target in LINEAR_UNARY:  # linear maps keep a partial sum partial (dropout's masks differ per rank)
        out.append(_all(op, "P"))
    return out


def _broadcast(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """Operands align from the right; a broadcast (size-1 or missing) dim stays Replicate."""
    result = []
    for p in _candidates(out_shape, tp):
        d = shard_dim(p)
        if d is not None:
            result.append(Strategy("", _aligned(op, graph, out_shape, d), p))
    tensors = len(op.inputs)
    if op.target in ADDITIVE and tensors >= 1 and _only_tensor_operands(op):
        # a sum of partial sums is a partial sum; adding a replicated term is not
        result.append(_all(op, "P"))
    if op.target in MULTIPLICATIVE and tensors >= 1:
        # scaling is linear in one factor: P * R stays P (the divisor must be replicated)
        for i in range(tensors if op.target in {"mul", "imul", "__mul__", "__rmul__", "mul_"} else 1):
            result.append(Strategy("", tuple("P" if j == i else "R" for j in range(tensors)), "P"))
    return result


def _only_tensor_operands(op: Op) -> bool:
    args = list(op.node.args) + list(op.node.kwargs.values())
    return all(isinstance(a, torch.fx.Node) for a in args if not isinstance(a, (str, type(None))))


def _map_view_dim(src, dst, d: int, tp: int) -> int | None:
    for gi, gj in view_groups(tuple(src), tuple(dst)):
        if d not in gi:
            continue
        if any(src[k] != 1 for k in gi[: gi.index(d)]):
            return None  # the shard would interleave with an outer dim
        outs = [k for k in gj if dst[k] != 1]
        if outs and dst[outs[0]] % tp == 0:
            return outs[0]
        return None
    return None


def _view(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    src = _shape(graph, op.inputs[0])
    result = [Strategy("", ("P",) + ("R",) * (len(op.inputs) - 1), "P")]
    for d, n in enumerate(src):
        if n % tp or n < tp:
            continue
        o = _map_view_dim(src, out_shape, d, tp)
        if o is not None:
            result.append(Strategy("", (f"S{d}",) + ("R",) * (len(op.inputs) - 1), f"S{o}"))
    found = view_parts(tuple(src), tuple(out_shape))
    if found and out_shape[found[0] + 1] % tp == 0:
        # [b, s, k*h*d] packed [q_r; k_r; v_r] on each rank views locally as [b, s, k, h/tp, d]:
        # the heads dim of the global [b, s, k, h, d], sharded
        d, k = found
        result.append(Strategy("", (packed(d, k),) + ("R",) * (len(op.inputs) - 1), f"S{d + 1}"))
    if op.target in ("view_as", "reshape_as") and len(op.inputs) == 2:
        # ``x.reshape_as(q)`` reads q for its shape: split as the output is, its local shape is
        # the local target (RoFormer's rotate-half ``stack([-q[..., 1::2], ...]).reshape_as(q)``)
        result += [Strategy("", (s.inputs[0], s.output), s.output) for s in result if s.output.startswith("S")]
    return result


def _permute(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    order = permutation(op, len(out_shape))
    if order is None:
        return []
    result = [Strategy("", ("P",), "P")]
    src = _shape(graph, op.inputs[0])
    for o, d in enumerate(order):
        if src[d] % tp == 0 and src[d] >= tp:
            result.append(Strategy("", (f"S{d}",), f"S{o}"))
    return result


def _dim_arg(op: Op, ndim: int, default: Any = None) -> Any:
    if "dim" in op.node.kwargs:
        dim = op.node.kwargs["dim"]
    elif len(op.node.args) > 1 and not isinstance(op.node.args[1], torch.fx.Node):
        dim = op.node.args[1]
    else:
        dim = default
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return {int(x) % ndim for x in dims}


def _reduce(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    src = _shape(graph, op.inputs[0])
    dims = _dim_arg(op, len(src))
    if dims is None:
        return [Strategy("", ("P",), "P")] if op.target in REDUCE_SUM else []
    keep = bool(op.node.kwargs.get("keepdim", False)) or op.target in ("softmax", "log_softmax", "cumsum")
    # a sum of partial sums is the partial sum of the sum, whichever dims it adds up (Llama 4's
    # MoE sums its top-k expert outputs, each a partial sum over the ranks' experts)
    result = [Strategy("", ("P",), "P")] if op.target in REDUCE_SUM else []
    for d, n in enumerate(src):
        if n % tp or n < tp:
            continue
        if d in dims:
            if op.target in REDUCE_SUM:  # summing the sharded dim leaves a partial sum
                result.append(Strategy("", (f"S{d}",), "P"))
            continue
        o = d if keep else d - sum(1 for r in dims if r < d)
        result.append(Strategy("", (f"S{d}",), f"S{o}"))
    return result


def _matmul(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    if len(op.inputs) != 2:
        return []
    a, b = (_shape(graph, v) for v in op.inputs)
    if len(a) < 2 or len(b) < 2:
        return []
    result = []
    nd = len(out_shape)
    for o in range(nd - 2):  # batch dims sharded on both operands, or on one that the other broadcasts along
        da, db = o - (nd - len(a)), o - (nd - len(b))
        if out_shape[o] % tp or out_shape[o] < tp:
            continue
        sa = f"S{da}" if da >= 0 and a[da] == out_shape[o] else "R" if da < 0 or a[da] == 1 else None
        sb = f"S{db}" if db >= 0 and b[db] == out_shape[o] else "R" if db < 0 or b[db] == 1 else None
        if sa and sb and (sa, sb) != ("R", "R"):
            result.append(Strategy("", (sa, sb), f"S{o}"))
    if a[-2] % tp == 0:
        result.append(Strategy("", (f"S{len(a) - 2}", "R"), f"S{nd - 2}"))
    if b[-1] % tp == 0:
        result.append(Strategy("", ("R", f"S{len(b) - 1}"), f"S{nd - 1}"))
    if a[-1] % tp == 0:  # contracting a sharded dim leaves partial sums
        result.append(Strategy("", (f"S{len(a) - 1}", f"S{len(b) - 2}"), "P"))
    return result


def _sdpa(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """Attention is independent along every dim before the last two (``[..., L, E]``): batch
    and heads of ``[b, h, L, E]``, the heads of mistral-inference's ``[h, L, E]``; never L."""
    return [Strategy("", _aligned(op, graph, out_shape, d), f"S{d}") for d in range(len(out_shape) - 2)
            if out_shape[d] % tp == 0]


def _aligned(op: Op, graph: OpGraph, out_shape, d: int) -> tuple[str, ...]:
    """Each operand's placement for an output sharded on ``d``, aligning dims from the right:
    an operand without that dim (or with size 1 there, broadcast) stays Replicate."""
    ins = []
    for v in op.inputs:
        shape = _shape(graph, v)
        local = d - (len(out_shape) - len(shape))
        ins.append("R" if local < 0 or shape[local] == 1 else f"S{local}")
    return tuple(ins)


def _cat(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    ndim = len(out_shape)
    dim = op.node.kwargs.get("dim", op.node.args[1] if len(op.node.args) > 1 else 0)
    stack = op.target == "stack"
    dim = int(dim) % (ndim if stack else ndim)
    result = []
    in_shape = _shape(graph, op.inputs[0])
    for d, n in enumerate(in_shape):
        o = d + 1 if stack and d >= dim else d
        if o == dim or n % tp or n < tp:
            continue
        result.append(Strategy("", tuple(f"S{d}" for _ in op.inputs), f"S{o}"))
    return result


def _split(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    src = _shape(graph, op.inputs[0])
    dims = _dim_arg(op, len(src), default=0)
    if op.target in ("chunk", "split", "tensor_split"):
        dims = {int(op.node.kwargs.get("dim", op.node.args[2] if len(op.node.args) > 2 else 0)) % len(src)}
    result = [Strategy("", ("P",), "P")]
    for d, n in enumerate(src):
        if d in dims or n % tp or n < tp:
            continue
        o = d - 1 if op.target == "unbind" and d > min(dims) else d
        result.append(Strategy("", (f"S{d}",), f"S{o}"))
    (d,) = dims if len(dims) == 1 else (None,)
    k = split_parts(op, src[d]) if d is not None else None
    if k is not None:  # packed input: each rank holds its slice of every part, so local chunks
        if src[d] % (k * tp) == 0:  # are the parts' local slices
            result.append(Strategy("", (packed(d, k),), f"S{d}"))
    widths = split_widths(op, src[d]) if d is not None and k is None else None
    if widths and all(w % tp == 0 for w in widths):  # unequal parts, each its own rank's slice (PackedShard)
        result.append(Strategy("", (packed(d, len(widths)),), f"S{d}"))
    return result


def _getitem(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    src_node = op.node.args[0]
    if isinstance(src_node.meta.get("val"), (tuple, list)):
        # element of a tuple: carries the tuple's placement
        return [Strategy("", (p,), p) for p in _candidates(out_shape, tp) + ["P"] if p != "R"]
    src = _shape(graph, op.inputs[0])
    result = _packed_slice(op.node.args[1], src, tp) + _unequal_slice(op, graph, tp)
    mapping = _index_dim_map(op.node.args[1], src) or _gathered_dim_map(op.node.args[1], src)
    if mapping is None:
        return result
    rest = ("R",) * (len(op.inputs) - 1)  # index tensors: whole on every rank
    for d, o in mapping.items():
        if src[d] % tp == 0 and src[d] >= tp and out_shape[o] == src[d]:
            result.append(Strategy("", (f"S{d}",) + rest, f"S{o}"))
    return result


def _narrow(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """``x.narrow(dim, start, length)``: one part of a packed projection, as ``x[..., a:b]``;
    the dims it keeps whole keep their shards."""
    src = _shape(graph, op.inputs[0])
    index = narrow_index(op.node.args, len(src))
    if index is None:
        return []
    dim = len(index) - 1
    return _packed_slice(index, src, tp) + _unequal_slice(op, graph, tp) + [Strategy("", (f"S{d}",), f"S{d}") for d in range(len(src))
                                             if d != dim and src[d] % tp == 0 and src[d] >= tp]


def _packed_slice(index: Any, src: tuple[int, ...], tp: int) -> list[Strategy]:
    """``qkv[..., :q_pos]`` of a packed projection: the rank holds its slice of every part
    [q_r; k_r; v_r], so slicing one part's local block gives that part's Shard(d)."""
    found = sliced_part(index, src)
    if found is None or found[0] != len(src) - 1 or src[found[0]] % (found[1] * tp):
        return []
    d, k = found
    return [Strategy("", (packed(d, k),), f"S{d}")]


def _unequal_slice(op: Op, graph: OpGraph, tp: int) -> list[Strategy]:
    """One of the ranges that together tile a packed projection of unequal parts (Phi-3's
    q, k, v slices): the rank holds its slice of every part (PackedShard), so its local
    range, the bounds made local, is that part's Shard(last)."""
    widths = slice_partition(graph, op.inputs[0])
    if not widths or len(set(widths)) == 1 or any(w % tp for w in widths):
        return []
    last = len(_shape(graph, op.inputs[0])) - 1
    return [Strategy("", (packed(last, len(widths)),), f"S{last}")]


def _index_dim_map(index: Any, src_shape: tuple[int, ...]) -> dict[int, int] | None:
    """Basic indexing: source dims kept whole by a slice (``slice(None)``, or one that spans
    the dim: Hugging Face's ``hidden_states[:, slice(-0, None), :]`` of ``logits_to_keep=0``)
    -> their output dim."""
    ndim = len(src_shape)
    items = index_items(index, ndim)
    if any(isinstance(i, torch.fx.Node) for i in items):
        return None
    mapping, src, out = {}, 0, 0
    for item in items:
        if item is None:
            out += 1
        elif isinstance(item, int):
            src += 1
        elif isinstance(item, slice):
            if _spans(item, src_shape[src] if src < ndim else 0):
                mapping[src] = out
            src += 1
            out += 1
        else:
            return None
    for rest in range(src, ndim):
        mapping[rest] = out + rest - src
    return mapping


def _gathered_dim_map(index: Any, src_shape: tuple[int, ...]) -> dict[int, int] | None:
    """One integer tensor index among ``:`` items (``table[idx]``, ``x[:, idx]``: Swin's
    relative-position bias ``table[index.view(-1)]`` of a ``[positions, heads]`` table):
    the indexed dim is replaced by the index's dims, every other dim keeps its shards
    (each rank gathers the rows of its own columns, its heads' biases)."""
    items = index_items(index, len(src_shape))
    nodes = [i for i in items if isinstance(i, torch.fx.Node)]
    val = nodes[0].meta.get("val") if len(nodes) == 1 else None
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32) or len(items) > len(src_shape):
        return None
    at = next(k for k, i in enumerate(items) if i is nodes[0])
    if any(not (isinstance(i, slice) and i == slice(None)) for k, i in enumerate(items) if k != at):
        return None
    return {d: d if d < at else d - 1 + val.dim() for d in range(len(src_shape)) if d != at}


def _propagated(op: Op, graph: OpGraph, n: int, out_shape) -> list[Strategy]:
    """DTensor's answer on ``n`` shards, as a rule :func:`.heads.grouped_variants` can run."""
    return [Strategy("", ins, out) for ins, out in dtensor_strategies(op, graph, tp=n)]


def _spans(item: slice, size: int) -> bool:
    if item == slice(None):
        return True
    bounds = (item.start, item.stop, item.step)
    return all(b is None or isinstance(b, int) for b in bounds) and range(*item.indices(size)) == range(size)


def sums_rows(op: Op, s: Strategy) -> bool:
    """``s`` keeps a hand-written MoE's partial sums at routed rows (:func:`_partial_sums`).
    Over an ep axis a list of experts is run by its dispatch, whose replay of the loop the
    program does not price on partial sums."""
    return s in _partial_sums(op)


def _partial_sums(op: Op) -> list[Strategy]:
    """The partial sums a hand-written MoE keeps at its routed rows, one rule: every op here
    is linear in the partial sums it reads, the indices read whole. Zeros on every rank are a
    partial sum of zeros (:data:`ZEROS`); rows added at whole indices (:data:`ADD_AT`), rows
    taken at whole indices (``out[rows]``), rows written back (mistral's ``out[rows] += y``,
    a ``setitem``) and ``out.view_as(x)`` (``x`` read for its shape) keep one."""
    n = len(op.inputs)
    if op.target in ZEROS:
        return [Strategy("", (ANY,) * n, "P")]
    if op.target in ADD_AT | {"setitem"} and n == 3:  # self, index, source
        return [Strategy("", ("P", "R", "P"), None if op.target == "setitem" else "P")]
    if op.target == "getitem" and n > 1:  # self, indices
        return [Strategy("", ("P",) + ("R",) * (n - 1), "P")]
    if op.target in ("view_as", "reshape_as") and n == 2:
        return [Strategy("", ("P", "R"), "P")]
    return []


def _new_tensor(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    """``x.new_empty(size)``: data-free, ``x`` gives its dtype and device only, so ``x`` may
    take any placement and the result any of its own: whole (``q.new_full((T, T), -inf)``,
    a mask sized by the sequence beside q split by heads) or split, when the code sizes it
    from a local tensor (``k.new_empty((*k.shape[:-1], d))``, DeepSeek's key buffer); the
    local check proves which (a size written as a global number fails a split one)."""
    if not op.inputs:
        return []
    return [Strategy("", (ANY,) + ("R",) * (len(op.inputs) - 1), o) for o in _candidates(out_shape, tp)]


def _expand(op: Op, graph: OpGraph, tp: int, out_shape) -> list[Strategy]:
    src = _shape(graph, op.inputs[0])
    lead = len(out_shape) - len(src)
    rest = ("R",) * (len(op.inputs) - 1)
    result = []
    for d, n in enumerate(src):
        if n == out_shape[d + lead] and n % tp == 0 and n >= tp:
            result.append(Strategy("", (f"S{d}",) + rest, f"S{d + lead}"))
    # a whole value repeated along a new dim (a mask expanded to every head): each rank's rows
    # are copies, if the code expands to the local size (the local head count, or expand_as
    # of a tensor split the same way, whose local shape it then reads)
    for o in expanded_dims(src, out_shape):
        if out_shape[o] % tp == 0:
            like = (f"S{o}",) if op.target == "expand_as" and len(op.inputs) == 2 else rest
            result.append(Strategy("", ("R",) + like, f"S{o}"))
    return result



_SHARD_LOCAL = {_unary, _broadcast, _view, _permute, _reduce, _getitem, _narrow, _cat, _split}

