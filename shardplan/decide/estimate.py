"""Estimate: what a solved plan costs per training step, counted the way DTensor runs it.

Contract
--------
``estimate(graph, solution, entries, ctx)`` returns a :class:`~shardplan.plan.Estimate`:
the collectives of one forward and one backward (per kind), the bytes each device sends,
predicted compute and communication time, parameter bytes per device and peak memory
(parameters, gradients and optimizer state at ``training_bytes_per_param``, plus saved
activations). Counts follow the emitter exactly: a region entry realized by one
``PrepareModuleInput`` is one collective, otherwise one per consuming Linear; this is what
``CommDebugMode`` sees, and the tests hold the two equal.

Given the plan's ``mesh``, the collectives data parallelism adds on the other axes are a
third entry, ``data_parallel`` (per step, forward and backward together; see
:mod:`.fsdp`): FSDP's all-gathers, reduce-scatters (and HSDP's all-reduces) of each
unit's parameters at their tp shard, or DDP's one gradient all-reduce, each priced on the
link of the data axis it runs over. They count in the bytes and the step time.
"""

from __future__ import annotations

from collections import Counter

from . import cost
from ..analyze.graph import OpGraph
from ..plan.model import Collectives, Estimate, MeshInfo
from .assemble import repeats
from .fsdp import DataParallelEvent, data_parallel_events, fsdp_units, unit_of
from .regions import Entry, PartialBlock, partial_grad_params
from .scatter import is_cut, is_gather, is_scatter, is_sum
from .slices import is_slice, received_once
from .solve import comm_time as op_comm_time
from .solve import BUCKETED_GRAD_STYLES, Solution, SolveContext, _model_dtype_bytes, _tied_second_owners, strategy_time

__all__ = ["estimate", "collective_list", "entry_events", "data_parallel_list", "unit_param_bytes"]

Event = tuple[str, str, int, int]  # (phase, kind, logical bytes, group size: 0 for the whole tp axis)


# styles whose weight gradients are Partial (the weight saw 1/tp of the tokens or heads)
PARTIAL_GRAD_STYLES = BUCKETED_GRAD_STYLES


def collective_list(
    graph: OpGraph, solution: Solution, entries: list[Entry], blocks: list[PartialBlock] = (), *, bucket: bool = True
) -> list[tuple[Event, int]]:
    """Every collective of one forward + backward with its repeat count. ``bucket``: the
    Partial weight gradients of PARTIAL_GRAD_STYLES are reduced together, one all-reduce of
    all their bytes when backward ends (:mod:`shardplan.apply.gradsync`); without it, one
    per parameter (what FSDP2 does for them after ``fully_shard``)."""
    events: Counter = Counter()
    partial = {r for b in blocks for r in b.rowwise}
    for b in blocks:  # one all-reduce at the block's exit instead of one per branch
        events[("forward", "all_reduce", graph.values[b.output].nbytes, 0)] += graph.ops[b.rowwise[0]].multiplicity
    bucketed = 0
    for op in graph.ops:
        s = solution.strategies[op.index]
        for kind, n in s.fwd if op.index not in partial else ():
            events[("forward", kind, n, 0)] += op.multiplicity
        for phase, kind, n, group in s.group_comms:
            events[(phase, kind, n, group)] += op.multiplicity
        reached = op.output is None or op.output in graph.grad_reaches
        for kind, n in s.bwd if reached else ():
            if bucket and s.name in PARTIAL_GRAD_STYLES:
                bucketed += n * op.multiplicity
            else:
                events[("backward", kind, n, 0)] += op.multiplicity
        for n in s.layouts.get("partial_bytes", ()) if reached else ():  # dtensor_weights' whole parameters
            if bucket:
                bucketed += n * op.multiplicity
            else:
                events[("backward", "all_reduce", n, 0)] += op.multiplicity
    for op in _partial_param_ops(graph, solution):  # a container's whole parameter with a Partial gradient
        n = graph.values[op.output].nbytes
        if bucket:
            bucketed += n * op.multiplicity
        else:
            events[("backward", "all_reduce", n, 0)] += op.multiplicity
    if bucketed:
        events[("backward", "all_reduce", bucketed, 0)] += 1
    for group, n in sorted(_group_grad_bytes(graph, solution).items()):
        # kv weights replicated on `group` ranks: one bucket per group size (gradsync), or
        # under fully_shard one reduction per parameter
        events[("backward", "all_reduce", n if bucket else n // group[1], group[0])] += 1 if bucket else group[1]
    for e in entries:
        events.update(entry_events(graph, e))
    return sorted(events.items())


def entry_events(graph: OpGraph, e: Entry) -> Counter:
    """The collectives of one region entry: ``(phase, kind, bytes, group) -> times``."""
    events: Counter = Counter()
    n = graph.values[e.value].nbytes
    times = e.num_collectives * graph.ops[e.consumers[0]].multiplicity
    # no gradient flows into model inputs, nor into a value only an argmax reads
    needs_grad = e.value in graph.requires_grad and e.value in graph.grad_reaches
    reached = {c for c in e.consumers if graph.ops[c].output is None or graph.ops[c].output in graph.grad_reaches}
    back = e.gradient_collectives(reached) * graph.ops[e.consumers[0]].multiplicity
    if is_scatter(e.kind) or is_cut(e.kind):
        # made where the module returns, once per call of it: a position-encoding module before
        # the blocks runs once, whatever the blocks reading its output do
        times = e.num_collectives * graph.ops[graph.values[e.value].producer].multiplicity
    if is_gather(e.kind):  # gathered where its module receives it; the whole gradient sliced back
        events[("forward", "all_gather", n, 0)] += times
    elif is_sum(e.kind):  # Partial -> Replicate where the module returns; the whole gradient is every rank's
        events[("forward", "all_reduce", n, 0)] += times
    elif is_scatter(e.kind):  # Partial -> Shard(seq) where the module returns; its gradient all-gathered back
        events[("forward", "reduce_scatter", n, 0)] += times
        if needs_grad:
            events[("backward", "all_gather", n, 0)] += times
    elif is_slice(e.kind):  # a whole value cut where its module receives it; a gradient all-gathered back
        if needs_grad:
            at = graph.values[e.value].producer if received_once(graph, e.value) else e.consumers[0]
            events[("backward", "all_gather", n, 0)] += len(e.sites) * graph.ops[at].multiplicity
    elif is_cut(e.kind):  # a whole value cut where its module returns; its gradient all-gathered back
        if needs_grad:
            events[("backward", "all_gather", n, 0)] += times
    elif e.kind == "R" and needs_grad and back:  # Partial input gradient -> Replicate
        events[("backward", "all_reduce", n, 0)] += back
    elif e.kind != "R" and e.num_collectives:  # Shard(seq) -> Replicate on entry; its gradient reduce-scattered back
        events[("forward", "all_gather", n, 0)] += times
        if needs_grad and back:
            events[("backward", "reduce_scatter", n, 0)] += back
    return events


def _group_grad_bytes(graph: OpGraph, solution: Solution) -> dict[tuple[int, int], int]:
    """(group size, parameters) -> bytes of the Partial gradients reduced over that group."""
    sizes: dict[int, list[int]] = {}
    for op in graph.ops:
        for n, g in solution.strategies[op.index].group_grads:
            sizes.setdefault(g, []).extend([n] * op.multiplicity)
    return {(g, len(ns)): sum(ns) for g, ns in sizes.items()}


def _partial_param_ops(graph: OpGraph, solution: Solution) -> list:
    fqns = set(partial_grad_params(graph, solution))
    return [op for op in graph.ops if op.kind == "const" and op.target in fqns]


def estimate(
    graph: OpGraph, solution: Solution, entries: list[Entry], ctx: SolveContext, *, blocks: list[PartialBlock] = (),
    mesh: MeshInfo | None = None,
) -> Estimate:
    """The step's estimate; with ``mesh``, its data axes' collectives too (module docstring)."""
    counts = {"forward": Counter(), "backward": Counter()}
    comm_bytes = comm_time = 0.0
    logical = {"forward": 0.0, "backward": 0.0}
    data = data_parallel_list(graph, solution, ctx, mesh)
    # under fully_shard, FSDP2 reduces the Partial norm gradients itself, one by one
    fsdp = bool(data) and getattr(ctx.opts, "data_parallel", "fsdp") == "fsdp"
    for (phase, kind, n, group), times in collective_list(graph, solution, entries, blocks, bucket=not fsdp):
        counts[phase][kind] += times
        logical[phase] += n * times
        comm_bytes += cost.collective_bytes(kind, n, group_size=group or ctx.tp) * times
        comm_time += cost.collective_time(kind, n, group_size=group or ctx.tp, link=ctx.link) * times
    if data:
        counts["data_parallel"], logical["data_parallel"] = Counter(), 0.0
    for e in data:
        counts["data_parallel"][e.kind] += e.times
        logical["data_parallel"] += e.nbytes * e.times
        comm_bytes += cost.collective_bytes(e.kind, e.nbytes, group_size=e.group_size) * e.times
        comm_time += cost.collective_time(e.kind, e.nbytes, group_size=e.group_size, link=e.link) * e.times
    total_time = sum(strategy_time(solution.strategies[op.index], ctx) * op.multiplicity for op in graph.ops)
    own_comm = sum(op_comm_time(solution.strategies[op.index], ctx) * op.multiplicity for op in graph.ops)
    compute_time = total_time - own_comm
    params = _param_bytes(graph, solution)
    elem = _model_dtype_bytes(graph)
    acts = activation_bytes(graph, solution, ctx)
    peak = params / elem * cost.training_bytes_per_param(dtype=ctx.dtype, optimizer=_optimizer(ctx)) / ctx.state_shards + acts
    return Estimate(
        param_bytes_per_device=params,
        peak_memory_bytes=peak,
        comm_bytes_per_step=comm_bytes,
        step_time_s=compute_time + comm_time,
        compute_time_s=compute_time,
        comm_time_s=comm_time,
        collectives={phase: Collectives(**dict(c)) for phase, c in counts.items()},
        collective_bytes=logical,
    )


def data_parallel_list(
    graph: OpGraph, solution: Solution, ctx: SolveContext, mesh: MeshInfo | None
) -> list[DataParallelEvent]:
    """The data axes' collectives of one step (``options.data_parallel``: fsdp or ddp), over
    the units :func:`.fsdp.fsdp_units` gives (the ones ``fully_shard_plan`` wraps, at its
    default ``reshard_after_forward``); empty without data axes."""
    if mesh is None:
        return []
    data_axes = {a: n for a, n in mesh.axes.items() if a != mesh.tp_axis}
    units = fsdp_units(repeats(graph), graph.model)
    sizes = unit_param_bytes(graph, solution, units)
    scale = cost.dtype_bytes(ctx.dtype) / _model_dtype_bytes(graph)  # gathered in the training dtype
    return data_parallel_events(
        [(sizes[u] * scale, reshard) for u, reshard in units], data_axes, cost.axis_links(ctx.hardware, mesh.axes),
        mode=getattr(ctx.opts, "data_parallel", "fsdp"),
    )


def unit_param_bytes(graph: OpGraph, solution: Solution, units: list[tuple[str, bool]]) -> dict[str, float]:
    """Per FSDP unit, the bytes of its parameters at the tp shard (a tied parameter once):
    a planned module as its chosen strategy holds it (a folded copy as its representative),
    a parameter the forward never reaches through a weight module (unused, a container's
    own) whole, as the plan replicates it."""
    planned = {op.target: solution.strategies[op.index] for op in graph.ops if op.kind == "module"}
    folded = graph.traced.folded
    out = {u: 0.0 for u, _ in units}
    seen: set[int] = set()
    for fqn, mod in graph.model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) not in seen]
        if not own or _read_by_planned_parent(_representative(fqn, folded), planned):
            continue
        fresh = len(own) == len(list(mod.parameters(recurse=False)))  # not a tied second owner
        seen.update(id(p) for p in own)
        s = planned.get(_representative(fqn, folded))
        local = s.param_bytes if s is not None and fresh else sum(p.numel() * p.element_size() for p in own)
        out[unit_of(fqn, units)] += local
    return out


def _read_by_planned_parent(fqn: str, planned: dict) -> bool:
    """``mha.out_proj``: its parameters are in its parent weight module's strategy."""
    parts = fqn.split(".")
    return any(".".join(parts[:k]) in planned for k in range(1, len(parts)))


def _representative(fqn: str, folded: dict[str, str]) -> str:
    """``layers.3.attention.wq`` -> ``layers.0.attention.wq`` when ``layers.3`` folds into
    ``layers.0``; folds followed until none applies (experts folded inside a folded layer:
    ``layers.3.moe.experts.5.w1`` -> ``layers.0.moe.experts.0.w1``)."""
    while True:
        copy = next((c for c in folded if fqn == c or fqn.startswith(c + ".")), None)
        if copy is None:
            return fqn
        fqn = folded[copy] + fqn[len(copy):]


def _optimizer(ctx: SolveContext) -> str:
    return getattr(ctx.opts, "optimizer", "adamw")


def activation_bytes(graph: OpGraph, solution: Solution, ctx: SolveContext) -> float:
    """Saved activations per device. Repeated transformer blocks use Korthikanti et al. 2022
    (with the block's batch, sequence, hidden size and attention heads read off the graph,
    and sequence parallel when the block's input is sequence-sharded); everything else sums
    the op outputs a rank holds."""
    scale = cost.dtype_bytes(ctx.dtype) / _model_dtype_bytes(graph)
    blocks = {rep: _block_shape(graph, rep) for rep in set(graph.traced.folded.values()) if rep in graph.traced.calls}
    blocks = {rep: shape for rep, shape in blocks.items() if shape is not None}
    total = 0.0
    for op in graph.ops:
        if not any(op.owner == r or op.owner.startswith(r + ".") or op.target.startswith(r + ".") for r in blocks):
            total += solution.strategies[op.index].act_bytes * op.multiplicity * scale
    for rep, (b, s, h, a, x) in blocks.items():
        layers = graph.module_multiplicity.get(rep, 0) or 1 + sum(1 for r in graph.traced.folded.values() if r == rep)
        sp = solution.placements.get(x, "R") == "S1"
        total += layers * cost.activation_bytes_per_layer(
            seq_len=s, batch_size=b, hidden=h, num_heads=a, tp=ctx.tp, sequence_parallel=sp,
            dtype_bytes=cost.dtype_bytes(ctx.dtype),
        )
    return total


def _block_shape(graph: OpGraph, rep: str) -> tuple[int, int, int, int, int] | None:
    """(batch, seq, hidden, heads, input value) of a transformer block, or None."""
    call = graph.traced.calls[rep][0]
    x = next((a for a in call.args if a is not None), None)
    sdpa = next((op for op in graph.ops if op.target == "scaled_dot_product_attention"
                 and (op.owner == rep or op.owner.startswith(rep + "."))), None)
    if x is None or sdpa is None or len(x.meta["val"].shape) != 3:
        return None
    b, s, h = x.meta["val"].shape
    return b, s, h, graph.values[sdpa.inputs[0]].shape[1], x.meta["shardplan_op"]


def _param_bytes(graph: OpGraph, solution: Solution) -> float:
    """Per device: planned modules as sharded, weights the forward never touched as replicated."""
    tied = _tied_second_owners(graph)
    total = sum(
        solution.strategies[op.index].param_bytes * op.multiplicity
        for op in graph.ops if op.kind == "module" and op.index not in tied
    )
    seen = _reached_params(graph)
    unused = sum(p.numel() * p.element_size() for p in graph.model.parameters() if id(p) not in seen)
    return total + unused


def _reached_params(graph: OpGraph) -> set[int]:
    """The parameters of the weight modules the forward calls, in the representative blocks
    and in each folded copy of them. Not every parameter of a called block: a decoder-only
    run of an encoder-decoder layer never calls its cross-attention, whose weights stay whole
    on every rank (BlenderbotForCausalLM: 0.84 GiB per device at tp=8 that a block's own
    parameters would have hidden)."""
    names = {op.target for op in graph.ops if op.kind == "module"}
    new = set(names)
    while new:  # folds nest (experts folded inside a folded layer): copies of copies too
        new = {copy + n[len(rep):] for copy, rep in graph.traced.folded.items() for n in new
               if n.startswith(rep + ".")} - names
        names |= new
    return {id(p) for n in names for p in graph.model.get_submodule(n).parameters()}
