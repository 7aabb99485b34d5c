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
"""

from __future__ import annotations

from collections import Counter

from . import cost
from ..analyze.graph import OpGraph
from ..plan.model import Collectives, Estimate
from .regions import Entry, PartialBlock
from .solve import Solution, SolveContext, _model_dtype_bytes, _tied_second_owners, strategy_time

__all__ = ["estimate", "collective_list"]

Event = tuple[str, str, int]  # (phase, kind, logical bytes)


def collective_list(
    graph: OpGraph, solution: Solution, entries: list[Entry], blocks: list[PartialBlock] = ()
) -> list[tuple[Event, int]]:
    """Every collective of one forward + backward with its repeat count."""
    events: Counter = Counter()
    partial = {r for b in blocks for r in b.rowwise}
    for b in blocks:  # one all-reduce at the block's exit instead of one per branch
        events[("forward", "all_reduce", graph.values[b.output].nbytes)] += graph.ops[b.rowwise[0]].multiplicity
    for op in graph.ops:
        s = solution.strategies[op.index]
        for kind, n in s.fwd if op.index not in partial else ():
            events[("forward", kind, n)] += op.multiplicity
        for kind, n in s.bwd:
            events[("backward", kind, n)] += op.multiplicity
    for e in entries:
        n = graph.values[e.value].nbytes
        times = e.num_collectives * graph.ops[e.consumers[0]].multiplicity
        needs_grad = e.value in graph.requires_grad  # no gradient flows into model inputs
        if e.kind == "R" and needs_grad:  # Partial input gradient -> Replicate
            events[("backward", "all_reduce", n)] += times
        elif e.kind != "R":  # Shard(seq) -> Replicate on entry; its gradient reduce-scattered back
            events[("forward", "all_gather", n)] += times
            if needs_grad:
                events[("backward", "reduce_scatter", n)] += times
    return sorted(events.items())


def estimate(
    graph: OpGraph, solution: Solution, entries: list[Entry], ctx: SolveContext, *, blocks: list[PartialBlock] = ()
) -> Estimate:
    counts = {"forward": Counter(), "backward": Counter()}
    comm_bytes = comm_time = 0.0
    logical = {"forward": 0.0, "backward": 0.0}
    for (phase, kind, n), times in collective_list(graph, solution, entries, blocks):
        counts[phase][kind] += times
        logical[phase] += n * times
        comm_bytes += cost.collective_bytes(kind, n, group_size=ctx.tp) * times
        comm_time += cost.collective_time(kind, n, group_size=ctx.tp, link=ctx.link) * times
    total_time = sum(strategy_time(solution.strategies[op.index], ctx) * op.multiplicity for op in graph.ops)
    own_comm = sum(
        cost.collective_time(k, n, group_size=ctx.tp, link=ctx.link) * op.multiplicity
        for op in graph.ops for k, n in solution.strategies[op.index].fwd + solution.strategies[op.index].bwd
    )
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
    seen = {id(p) for fqn in graph.module_multiplicity for p in graph.model.get_submodule(fqn).parameters()}
    for fqn in graph.traced.folded:
        seen.update(id(p) for p in graph.model.get_submodule(fqn).parameters())
    unused = sum(p.numel() * p.element_size() for p in graph.model.parameters() if id(p) not in seen)
    return total + unused
