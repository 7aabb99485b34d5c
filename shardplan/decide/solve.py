"""Solve: pick one strategy per op so the plan is valid, sharded, and fastest.

Contract
--------
``solve(graph, ctx)`` returns a :class:`Solution`: the chosen :class:`Strategy` of every
op and the placement of every value, optimal for the integer program below (HiGHS via
``highspy``, zero gap), with ties broken by strategy order so the same input
always gives the same answer.

The program
-----------
* one binary ``x[op, s]`` per op and strategy, exactly one chosen per op;
* every consumer reads a value in the placement its producer wrote (plain local tensors
  flow between modules, so no implicit redistribution exists; styles move data);
* folded repeated blocks read and write what their representative does, so a 126-layer
  model costs one block;
* ``z[value, entry]`` >= each consumer strategy that enters a region from that value:
  the region's entry collective is paid once per value, however many Linears share it.

Objective (lexicographic, as users ask for tensor parallelism to save memory):
0. with ``sequence_parallel=True``: the fewest norms kept off sequence shards, first;
1. without a memory budget: least parameter bytes per device (shard all that can be);
   then the fewest attentions run whole; then least predicted step time among those plans;
2. with a budget: least step time with memory per device <= budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import cost
from .milp import MilpModel, MilpView
from ..analyze.graph import Op, OpGraph
from .scatter import cut_rows, gather_rows, is_cut, is_gather, is_scatter, is_sum, scatter_rows, scatter_target
from .slices import is_inner_cut, is_slice, received_once, slice_rows, slice_target
from .placements import ANY, shard_dim
from .strategies import MATMUL, Strategy, op_strategies, sums_rows
from .weights import read_elsewhere
from .tied import weight_read_elsewhere

__all__ = ["SolveContext", "Solution", "solve", "PlanningError", "strategy_time", "comm_time", "work_time", "upkeep_time",
           "BUCKETED_GRAD_STYLES"]


class PlanningError(ValueError):
    """No valid plan under the given constraints; the message says what to change."""


@dataclass
class SolveContext:
    tp: int
    hardware: cost.Hardware
    link: cost.Link
    dtype: str = "bf16"
    memory_budget: int | None = None
    opts: Any = None
    # ranks that share the parameter, gradient and optimizer bytes beyond tp: the other mesh
    # axes under FSDP (each holds 1/dp of them), 1 under DDP
    state_shards: int = 1
    # op index -> style name, or (style name, layouts that must match, e.g. {"input": "S1"})
    forced: dict[int, str | tuple[str, dict[str, str]]] = field(default_factory=dict)
    # moe_whole_experts on offer: not on a mesh with an ep axis, whose banks are whole over ep
    # already and split over tp inside (moe_tp_experts) or not at all
    whole_experts: bool = True


@dataclass
class Solution:
    strategies: dict[int, Strategy]
    placements: dict[int, str]  # value id -> placement
    entries: dict[tuple[int, str], bool]  # (value, entry) -> a region enters there
    time_s: float
    param_bytes: float
    memory_bytes: float


@dataclass
class _Program:
    graph: OpGraph
    ctx: SolveContext
    strategies: dict[int, list[Strategy]]
    var_of: dict[tuple[int, int], int]  # (op, strategy index) -> column
    entry_of: dict[tuple[int, str], int]  # (value, entry) -> column
    entry_cost: dict[tuple[int, str], float]
    # group size -> column: 1 when any chosen strategy's gradients go in that bucket (its
    # latency is paid once per step, the bandwidth per strategy: comm_time)
    bucket_of: dict[int, int] = field(default_factory=dict)
    num_vars: int = 0
    # per column: (op, strategy index), None for entries and buckets; strategy i's base rank
    col_key: list[tuple[int, int] | None] = field(default_factory=list)
    base_tie: np.ndarray = field(default_factory=lambda: np.zeros(0))


def strategy_time(s: Strategy, ctx: SolveContext) -> float:
    """Predicted seconds of one training step's work for the op under strategy ``s``: its
    collectives, matmul FLOPs (forward + backward), bandwidth-bound traffic (forward +
    backward), the optimizer's update of the parameters it holds, and for a weight module
    under a parallel style the host's dispatch overhead."""
    compute, memory = _work(s, ctx)
    return comm_time(s, ctx) + compute + memory + _update_time(s, ctx) + _host_time(s, ctx)


def _work(s: Strategy, ctx: SolveContext) -> tuple[float, float]:
    compute = cost.matmul_time(s.flops, hardware=ctx.hardware, dtype=ctx.dtype) if s.flops else 0.0
    memory = cost.elementwise_time(s.mem_bytes, hardware=ctx.hardware) if s.mem_bytes else 0.0
    return compute, memory


def work_time(s: Strategy, ctx: SolveContext) -> float:
    """The op's matmul FLOPs and bandwidth-bound traffic, forward + backward: what scales with its rows."""
    compute, memory = _work(s, ctx)
    return compute + memory


def upkeep_time(s: Strategy, ctx: SolveContext) -> float:
    """The optimizer's update of the parameters the op holds and its dispatch overhead: per call, not per row."""
    return _update_time(s, ctx) + _host_time(s, ctx)


# styles whose backward collectives reduce Partial weight gradients, bucketed when backward ends
BUCKETED_GRAD_STYLES = ("sequence_parallel", "replicated_with_grad_allreduce")


def comm_time(s: Strategy, ctx: SolveContext) -> float:
    """The collectives of ``s``: its forward and backward ones, except that gradients reduced
    in one bucket when backward ends (a sequence-parallel norm's, a kv weight's over its
    group) pay only their bandwidth here; the bucket's latency is paid once per step (a
    column of the program). Under FSDP over data axes nothing is bucketed."""
    bucketed = _bucketing(ctx)
    own_bucket = bucketed and s.name in BUCKETED_GRAD_STYLES
    return (sum(_collective(k, n, ctx.tp, ctx) for k, n in s.fwd)
            + sum(_collective(k, n, ctx.tp, ctx, latency=not own_bucket) for k, n in s.bwd)
            + sum(_collective("all_reduce", n, g, ctx, latency=not bucketed) for n, g in s.group_grads)
            + sum(_collective("all_reduce", n, ctx.tp, ctx, latency=not bucketed) for n in s.layouts.get("partial_bytes", ()))
            + sum(_collective(k, n, g, ctx) for _, k, n, g in s.group_comms))


def _collective(kind: str, num_bytes: float, group: int, ctx: SolveContext, *, latency: bool = True) -> float:
    full = cost.collective_time(kind, num_bytes, group_size=group, link=ctx.link)
    return full if latency else full - cost.collective_time(kind, 0, group_size=group, link=ctx.link)


def _bucketing(ctx: SolveContext) -> bool:
    """shardplan's gradient sync buckets the Partial gradients (the estimate counts one
    collective per bucket), except under FSDP over data axes, which reduces them one by one."""
    return ctx.state_shards == 1


def _update_time(s: Strategy, ctx: SolveContext) -> float:
    """The optimizer step over the parameters ``s`` keeps on a device (a 1/state_shards part
    under FSDP). Parameter bytes are counted at the planning dtype's width: the model's,
    unless the user plans it for another."""
    if not s.param_bytes:
        return 0.0
    params = s.param_bytes / cost.dtype_bytes(ctx.dtype) / ctx.state_shards
    return cost.optimizer_time(params, hardware=ctx.hardware, optimizer=getattr(ctx.opts, "optimizer", "adamw"))


def _host_time(s: Strategy, ctx: SolveContext) -> float:
    """Dispatch overhead of a weight module under a parallel style (every strategy of a
    module pays it alike, so it moves the predicted time, never the choice); at tp=1 no
    style is applied."""
    return ctx.hardware.module_overhead_s if s.name not in ("", "folded") and ctx.tp > 1 else 0.0


_HOOK_S = 1e-7  # a region's hook where no hardware profile says what one costs: a tie-break, not a price


def entry_time(entry: str, nbytes: int, ctx: SolveContext, *, needs_grad: bool = True) -> float:
    if is_slice(entry) or is_inner_cut(entry):
        # a whole value cut locally: no collective, but a hook on the module that cuts it; a
        # value nothing reads split (RoPE tables no layer of this config uses) is left whole
        # rather than cut for nothing. The stream cut onto sequence shards all-gathers its
        # gradient; where a module returns it, cutting there (R^S1) is the same, and wins the tie
        return max(ctx.hardware.module_overhead_s, _HOOK_S) + (
            cost.collective_time("all_gather", nbytes, group_size=ctx.tp, link=ctx.link) + _HOOK_S if needs_grad else 0.0)
    if is_sum(entry):  # a partial sum all-reduced where its module returns (a hook: ties go to a Linear's own)
        return cost.collective_time("all_reduce", nbytes, group_size=ctx.tp, link=ctx.link) + max(
            ctx.hardware.module_overhead_s, _HOOK_S)
    if is_scatter(entry):  # a partial sum reduce-scattered where its module returns; its gradient all-gathered
        return cost.collective_time("reduce_scatter", nbytes, group_size=ctx.tp, link=ctx.link) + (
            cost.collective_time("all_gather", nbytes, group_size=ctx.tp, link=ctx.link) if needs_grad else 0.0)
    if is_cut(entry):  # a whole value cut where its module returns (a hook); its gradient all-gathered back
        return max(ctx.hardware.module_overhead_s, _HOOK_S) + (
            cost.collective_time("all_gather", nbytes, group_size=ctx.tp, link=ctx.link) if needs_grad else 0.0)
    if is_gather(entry):  # gathered where its module receives it; the readers hand back a whole gradient: sliced
        return cost.collective_time("all_gather", nbytes, group_size=ctx.tp, link=ctx.link)
    if entry == "R":  # Partial gradient of the region input -> one all-reduce in backward
        return cost.collective_time("all_reduce", nbytes, group_size=ctx.tp, link=ctx.link) if needs_grad else 0.0
    # sequence-sharded input: all-gather forward, reduce-scatter its gradient backward
    return (1 + needs_grad) * cost.collective_time("all_gather", nbytes, group_size=ctx.tp, link=ctx.link)


def _at_exit(entry: str) -> bool:
    return is_cut(entry) or is_scatter(entry)


def _aliases(graph: OpGraph) -> dict[int, int]:
    """Folded block outputs stand for their representative's outputs: the block's own value
    for its first, ``out[i]`` of a block returning a tuple for the representative's ``i``-th
    (T5's blocks hand the next one its position bias, split by heads beside the hidden state)."""
    alias: dict[int, int] = {}
    reps: dict[int, Any] = {}
    for op in graph.ops:
        if op.kind == "folded" and op.output is not None:
            rep = graph.traced.calls[graph.traced.folded[op.target]][0]
            reps[op.output] = rep
            if rep.outputs:
                alias[op.output] = rep.outputs[0].meta["shardplan_op"]
        elif op.kind == "function" and op.target == "getitem" and op.output is not None and op.inputs[:1]:
            rep = reps.get(op.inputs[0])
            index = op.node.args[1] if len(op.node.args) > 1 else None
            if rep is not None and isinstance(index, int) and index in rep.items:
                alias[op.output] = rep.items[index].meta["shardplan_op"]
    return alias


def _resolved(value: int, alias: dict[int, int]) -> int | None:
    """The representative's value a folded copy's output stands for; None for any other."""
    if value not in alias:
        return None
    while value in alias:
        value = alias[value]
    return value


def _producer(graph: OpGraph, value: int, alias: dict[int, int]) -> int:
    while value in alias:
        value = alias[value]
    return graph.values[value].producer


def _build(graph: OpGraph, ctx: SolveContext) -> _Program:
    """The program's columns: every strategy of every op (forced styles are bounds, applied
    per solve: see _allowed), entries and gradient buckets."""
    strategies: dict[int, list[Strategy]] = {}
    cache = graph.strategy_cache.setdefault((ctx.tp, repr(ctx.opts)), {})
    for op in graph.ops:
        if op.index not in cache:
            cache[op.index] = op_strategies(op, graph, tp=ctx.tp, opts=ctx.opts)
        strategies[op.index] = cache[op.index] if ctx.whole_experts else \
            [s for s in cache[op.index] if s.name != "moe_whole_experts" and not sums_rows(op, s)]
    prog = _Program(graph, ctx, strategies, {}, {}, {})
    for op_index, options in strategies.items():
        for i in range(len(options)):
            prog.var_of[(op_index, i)] = prog.num_vars
            prog.num_vars += 1
    for op in graph.ops:
        for slot, value in enumerate(op.inputs):
            for s in strategies[op.index]:
                entry = s.entry[slot] if slot < len(s.entry) else None
                if entry and (value, entry) not in prog.entry_of:
                    prog.entry_of[(value, entry)] = prog.num_vars
                    needs_grad = value in graph.requires_grad and value in graph.grad_reaches
                    # a conversion where a module returns runs once per call of that module; the
                    # stream cut where the first of a folded stack receives it, once
                    once = _at_exit(entry) or (is_slice(entry) and received_once(graph, value))
                    at = graph.ops[graph.values[value].producer] if once else op
                    prog.entry_cost[(value, entry)] = entry_time(
                        entry, graph.values[value].nbytes, ctx, needs_grad=needs_grad) * at.multiplicity
                    prog.num_vars += 1
    for options in strategies.values():
        for group in (g for s in options for g in _buckets(s, ctx)):
            if group not in prog.bucket_of:
                prog.bucket_of[group] = prog.num_vars
                prog.num_vars += 1
    prog.col_key = [None] * prog.num_vars
    prog.base_tie = np.zeros(prog.num_vars)
    for key, col in prog.var_of.items():
        prog.col_key[col], prog.base_tie[col] = key, key[1]
    return prog


@dataclass
class _Matrices:
    """A program's constraints (a :class:`.milp.MilpModel`) and per-column vectors, built
    once per graph and context: explain re-solves it once per alternative style, changing
    only the forced columns' bounds."""
    prog: _Program
    model: MilpModel
    time: np.ndarray
    params: np.ndarray
    acts: np.ndarray
    weights: np.ndarray
    whole_heads: np.ndarray
    off_sequence: np.ndarray


def _matrices(graph: OpGraph, ctx: SolveContext) -> _Matrices:
    key = ("program", ctx.tp, repr(ctx.opts), repr(ctx.hardware), repr(ctx.link), ctx.dtype, ctx.state_shards)
    cached = graph.strategy_cache.get(key)
    if cached is None:
        prog = _build(graph, replace(ctx, forced={}))
        rows, lo, hi = _rows(prog)
        _tied_rows(prog, rows, lo, hi)
        _same_module_rows(prog, rows, lo, hi)
        model = MilpModel.from_rows(rows, lo, hi, num_vars=prog.num_vars, integer=frozenset(prog.var_of.values()))
        cached = graph.strategy_cache[key] = _Matrices(prog, model, *_vectors(prog))
    return cached


def _allowed(prog: _Program, forced: dict) -> tuple[np.ndarray, np.ndarray, list[Op]]:
    """Upper bounds (0 on the columns a forced style excludes), each column's rank among its
    op's allowed strategies (the tie-break), and the ops left with none. Unforced ops allow
    every strategy, ranked in order; only the forced ops' columns are looked at."""
    upper, tie = np.ones(prog.num_vars), prog.base_tie.copy()
    empty = [op_index for op_index, options in prog.strategies.items() if not options]
    for op_index, want in forced.items():
        rank = 0
        for i, s in enumerate(prog.strategies.get(op_index, ())):
            col = prog.var_of[(op_index, i)]
            if not _forced_match(s, want):
                upper[col], tie[col] = 0.0, 0.0
                continue
            tie[col], rank = rank, rank + 1
        if not rank and op_index in prog.strategies:
            empty.append(op_index)
    return upper, tie, [prog.graph.ops[i] for i in sorted(set(empty))]  # op indices run in program order


def _buckets(s: Strategy, ctx: SolveContext) -> set[int]:
    """The gradient buckets (by group size) ``s`` puts gradients in."""
    if not _bucketing(ctx):
        return set()
    found = {g for _, g in s.group_grads}
    if (s.name in BUCKETED_GRAD_STYLES and s.bwd) or s.layouts.get("partial_bytes"):
        found.add(ctx.tp)
    return found


def _forced_match(s: Strategy, want: str | tuple[str, dict[str, str]]) -> bool:
    name, layouts = (want, {}) if isinstance(want, str) else want
    own = {"input": s.inputs[0] if s.inputs else None, "output": s.output}  # what a strategy does not restate
    return s.name == name and all(s.layouts.get(k, own.get(k)) == v for k, v in layouts.items())


def _rows(prog: _Program) -> tuple[list[dict[int, float]], list[float], list[float]]:
    """Equality and entry rows as sparse dicts with lower/upper bounds."""
    graph, rows, lo, hi = prog.graph, [], [], []
    alias = _aliases(graph)
    for op in graph.ops:
        rows.append({prog.var_of[(op.index, i)]: 1.0 for i in range(len(prog.strategies[op.index]))})
        lo.append(1.0)
        hi.append(1.0)
    for op in graph.ops:
        if op.kind == "folded":
            continue
        for slot, value in enumerate(op.inputs):
            producer = _producer(graph, value, alias)
            # a folded copy's output arrives as its representative's leaves that block, through
            # the conversions where it returns (a MoE stack's outputs reduce-scattered)
            _placement_rows(prog, op, slot, producer, rows, lo, hi, arriving=_resolved(value, alias))
            _entry_rows(prog, op, slot, value, rows, lo, hi)
    _folded_rows(prog, alias, rows, lo, hi)
    slice_rows(prog, rows, lo, hi)
    scatter_rows(prog, rows, lo, hi)
    cut_rows(prog, rows, lo, hi)
    gather_rows(prog, rows, lo, hi)
    for op in graph.ops:
        for i, s in enumerate(prog.strategies[op.index]):
            for group in _buckets(s, prog.ctx):
                rows.append({prog.bucket_of[group]: 1.0, prog.var_of[(op.index, i)]: -1.0})
                lo.append(0.0)
                hi.append(np.inf)
    return rows, lo, hi


def _placement_rows(prog: _Program, op: Op, slot: int, producer: int, rows, lo, hi, *, arriving: int | None = None) -> None:
    """The op takes input ``slot`` as its producer gives it: for each placement p, the op
    chooses a strategy reading p exactly when the producer chooses one giving p. A strategy
    reading ``ANY`` there takes any: then the op's choice of p only implies the producer's.
    ``arriving``: the representative's value a folded copy's output stands for, which
    arrives converted where its module returns it (:func:`_arrives_as`)."""
    mine = prog.strategies[op.index]
    theirs = prog.strategies[producer]
    free = any(s.inputs[slot] == ANY for s in mine)
    placements = ({s.inputs[slot] for s in mine} | {s.output for s in theirs if s.output}) - {ANY}
    for p in sorted(placements):
        row = {prog.var_of[(op.index, i)]: 1.0 for i, s in enumerate(mine) if s.inputs[slot] == p}
        made = _arrives_as(prog, producer, arriving, p) if arriving is not None else [
            (prog.var_of[(producer, i)], 1.0) for i, s in enumerate(theirs) if s.output == p]
        for col, coef in made:
            row[col] = row.get(col, 0.0) - coef
        rows.append(row)
        lo.append(-np.inf if free else 0.0)
        hi.append(0.0)


def _entry_rows(prog: _Program, op: Op, slot: int, value: int, rows, lo, hi) -> None:
    for i, s in enumerate(prog.strategies[op.index]):
        entry = s.entry[slot] if slot < len(s.entry) else None
        if entry:
            rows.append({prog.entry_of[(value, entry)]: 1.0, prog.var_of[(op.index, i)]: -1.0})
            lo.append(0.0)
            hi.append(np.inf)


def _folded_rows(prog: _Program, alias: dict[int, int], rows, lo, hi) -> None:
    """A folded block's inputs arrive as its representative's did."""
    graph = prog.graph
    for op in graph.ops:
        if op.kind != "folded":
            continue
        rep = graph.traced.calls[graph.traced.folded[op.target]][0]
        pairs = list(zip(op.node.args, rep.args)) + [(op.node.kwargs.get(k), n) for k, n in rep.kwargs.items()]
        for mine, theirs in pairs:
            if mine is None or theirs is None or not hasattr(mine, "meta") or "shardplan_op" not in mine.meta:
                continue
            if not {mine.meta["shardplan_op"], theirs.meta["shardplan_op"]} <= graph.values.keys():
                continue  # a Python value (a flag computed from the inputs' values): no placement
            a = _producer(graph, mine.meta["shardplan_op"], alias)
            b = _producer(graph, theirs.meta["shardplan_op"], alias)
            if a == b:
                continue
            outs = {s.output for s in prog.strategies[a]} | {s.output for s in prog.strategies[b]}
            for p in sorted(o for o in outs if o):
                row: dict[int, float] = {}
                for col, coef in _arrives_as(prog, a, mine.meta["shardplan_op"], p):
                    row[col] = row.get(col, 0.0) + coef
                for col, coef in _arrives_as(prog, b, theirs.meta["shardplan_op"], p):
                    row[col] = row.get(col, 0.0) - coef
                rows.append(row)
                lo.append(0.0)
                hi.append(0.0)


def _arrives_as(prog: _Program, producer: int, value: int, p: str) -> list[tuple[int, float]]:
    """The columns that say ``value`` reaches a block as ``p``: its producer's strategies
    making ``p``, and the conversions where its module returns it, which every reader takes
    (a whole value cut ``R^S1``, a partial sum reduce-scattered ``P>S1``: a position-encoding
    module's output cut onto the first block's sequence shards arrives as the later blocks'
    inputs do)."""
    cols = [(prog.var_of[(producer, i)], 1.0) for i, s in enumerate(prog.strategies[producer]) if s.output == p]
    for (v, entry), col in prog.entry_of.items():
        first = is_slice(entry) and received_once(prog.graph, v)  # cut where the first block receives it
        if v != value or not (is_cut(entry) or is_scatter(entry) or first):
            continue
        before = "R" if is_cut(entry) or first else "P"
        if (slice_target(entry) if first else scatter_target(entry)) == p:
            cols.append((col, 1.0))
        elif before == p:
            cols.append((col, -1.0))
    return cols


def _tied_rows(prog: _Program, rows, lo, hi) -> None:
    """Modules sharing one Parameter must shard it the same way."""
    graph = prog.graph
    owners: dict[int, list[int]] = {}
    for op in graph.ops:
        if op.kind == "module":
            for p in graph.model.get_submodule(op.target).parameters(recurse=False):
                owners.setdefault(id(p), []).append(op.index)
    for op in graph.ops:  # a module's weight read as a tensor outside it takes the module's layout
        if op.kind == "const" and weight_read_elsewhere(graph, op) is not None:
            owner, _, name = op.target.rpartition(".")
            param = graph.model.get_submodule(owner)._parameters.get(name)
            if param is not None and id(param) in owners:
                owners[id(param)].append(op.index)
    for ops in owners.values():
        for a, b in zip(ops, ops[1:]):
            if a != b:
                _same_choice(prog, a, b, lambda s: s.layouts.get("weight"), ("R", "S0", "S1"), rows, lo, hi)


def _same_module_rows(prog: _Program, rows, lo, hi) -> None:
    """A module called more than once (one embedding for a model's two inputs) has one rule,
    so every call takes the same style with the same layouts."""
    calls: dict[str, list[int]] = {}
    for op in prog.graph.ops:
        if op.kind == "module":
            calls.setdefault(op.target, []).append(op.index)
    for ops in calls.values():
        for a, b in zip(ops, ops[1:]):
            keys = {_rule_key(s) for s in prog.strategies[a]} | {_rule_key(s) for s in prog.strategies[b]}
            _same_choice(prog, a, b, _rule_key, sorted(keys, key=repr), rows, lo, hi)


def _same_choice(prog: _Program, a: int, b: int, key, values, rows, lo, hi) -> None:
    """Ops ``a`` and ``b`` pick strategies with the same ``key(strategy)``: for each value,
    the sum of a's columns with it equals the sum of b's."""
    for value in values:
        row = {prog.var_of[(a, i)]: 1.0 for i, s in enumerate(prog.strategies[a]) if key(s) == value}
        for i, s in enumerate(prog.strategies[b]):
            if key(s) == value:
                row[prog.var_of[(b, i)]] = row.get(prog.var_of[(b, i)], 0.0) - 1.0
        rows.append(row)
        lo.append(0.0)
        hi.append(0.0)


def _rule_key(s: Strategy) -> tuple:
    """What a module's rule records of its strategy."""
    return (s.name, *(repr(s.layouts.get(k)) for k in ("input", "output", "packed", "whole_parts", "groups", "output_grad", "input_grad")))


def _tied_second_owners(graph: OpGraph) -> set[int]:
    seen: set[int] = set()
    repeats: set[int] = set()
    for op in graph.ops:
        if op.kind != "module":
            continue
        params = [id(p) for p in graph.model.get_submodule(op.target).parameters(recurse=False)]
        if params and all(p in seen for p in params):
            repeats.add(op.index)
        seen.update(params)
    return repeats


def _vectors(prog: _Program) -> tuple[np.ndarray, ...]:
    """Per-column time, parameter bytes, activation bytes, weight bytes, attention run whole
    and norms kept off sequence shards (multiplicity applied)."""
    time = np.zeros(prog.num_vars)
    params = np.zeros(prog.num_vars)
    weights = np.zeros(prog.num_vars)
    acts = np.zeros(prog.num_vars)
    whole = np.zeros(prog.num_vars)
    off_sequence = np.zeros(prog.num_vars)
    tied = _tied_second_owners(prog.graph)
    for op in prog.graph.ops:
        for i, s in enumerate(prog.strategies[op.index]):
            col = prog.var_of[(op.index, i)]
            time[col] = strategy_time(s, prog.ctx) * op.multiplicity
            params[col] = 0.0 if op.index in tied else s.param_bytes * op.multiplicity
            weights[col] = 0.0 if op.index in tied else s.weight_bytes * op.multiplicity
            acts[col] = s.act_bytes * op.multiplicity
            whole[col] = op.multiplicity if _heads_whole(op, s, prog.graph) else 0.0
            off_sequence[col] = op.multiplicity if s.off_sequence else 0.0
    for key, col in prog.entry_of.items():
        time[col] = prog.entry_cost[key]
    for group, col in prog.bucket_of.items():
        time[col] = cost.collective_time("all_reduce", 0, group_size=group, link=prog.ctx.link)
    return time, params, acts, weights, whole, off_sequence


def _heads_whole(op: Op, s: Strategy, graph: OpGraph) -> bool:
    """Attention computed whole on every rank: ``scaled_dot_product_attention`` with a whole
    output, an attention module (``nn.MultiheadAttention``) replicated, or attention written
    as batched products of two activations (``q @ k.transpose(-1, -2)``, then ``probs @ v``:
    Falcon's, nanoGPT's) with a whole output."""
    if op.kind == "module":
        return op.module_kind == "attention" and s.name == "replicate"
    if shard_dim(s.output or "R") is not None:
        return False
    if op.target in MATMUL and len(op.inputs) == 2 and op.output is not None:
        consts = graph.strategy_cache.get("const_values")
        if consts is None:
            consts = graph.strategy_cache["const_values"] = frozenset(o.output for o in graph.ops if o.kind == "const")
        return len(graph.values[op.output].shape) >= 3 and not any(v in consts for v in op.inputs)
    return op.target == "scaled_dot_product_attention"


def solve(graph: OpGraph, ctx: SolveContext) -> Solution:
    m = _matrices(graph, ctx)
    upper, tie, empty = _allowed(m.prog, ctx.forced)
    if empty:
        raise PlanningError(_no_strategy_message(empty[0], ctx, graph))
    b = m.model.view(upper)
    train_factor = cost.training_bytes_per_param(dtype=ctx.dtype, optimizer=getattr(ctx.opts, 'optimizer', 'adamw')) / _model_dtype_bytes(graph) / ctx.state_shards
    act_factor = cost.dtype_bytes(ctx.dtype) / _model_dtype_bytes(graph)
    memory = m.params * train_factor + m.acts * act_factor
    if ctx.memory_budget is None:
        x = _lexicographic(b, m, tie, memory, ctx.hardware.memory_bytes)
    else:
        bounds = _fewest(b, m.off_sequence, tie, [(memory, float(ctx.memory_budget))])
        x = b.minimize(b.scaled(m.time) + 1e-9 * tie, tuple(bounds)) if bounds is not None else None
        if x is None:
            raise PlanningError(_budget_message(b, memory, ctx))
    if x is None:
        tied = [op for op in graph.ops if op.kind == "module" and op.target in read_elsewhere(graph)
                and ctx.forced.get(op.index) not in (None, "replicate")]
        raise PlanningError(_no_strategy_message(tied[0], ctx, graph) if tied
                            else f"no valid tensor-parallel plan at tp={ctx.tp}; try a smaller tp")
    return _solution(m.prog, x, m.time, m.params, memory)


def _lexicographic(b: MilpView, m: _Matrices, tie: np.ndarray, memory: np.ndarray, device_bytes: float) -> np.ndarray | None:
    """When sequence parallel was asked for, the fewest norms kept off sequence shards first
    (every norm that any plan can split is split); then least weight bytes; then the fewest
    attentions run whole (split by heads, as the model's authors would, where any plan
    holding that few bytes can: at small sizes a plan that runs attention whole behind
    rowwise q/k/v can price a few microseconds faster); then, among those plans, the fastest
    that fits the device (sequence parallel, say, when activations would not fit), else the
    fastest."""
    weights, time = m.weights, m.time
    bounds = _fewest(b, m.off_sequence, tie, [])
    first = b.minimize(b.scaled(weights) + 1e-9 * tie, tuple(bounds)) if bounds is not None else None
    if first is None:
        return None
    bounds.append((weights, _total(weights, first) * (1 + 1e-9) + 1.0))
    bounds = _fewest(b, m.whole_heads, tie, bounds, first)
    fitting = b.minimize(b.scaled(time) + 1e-9 * tie, (*bounds, (memory, float(device_bytes))))
    return fitting if fitting is not None else b.minimize(b.scaled(time) + 1e-9 * tie, tuple(bounds))


def _fewest(b: MilpView, counts: np.ndarray, tie: np.ndarray, bounds: list, start: np.ndarray | None = None) -> list | None:
    """``bounds`` plus ``counts`` held at the least any plan within them reaches (a count of
    0/1 columns times multiplicity: +0.5 keeps the bound off the integer); unchanged when no
    column counts; None when nothing is within ``bounds``. ``start``, a plan within them,
    saves the solve when it already reaches 0."""
    if not counts.any():
        return bounds
    fewest = start if start is not None and _total(counts, start) == 0 else b.minimize(
        b.scaled(counts) + 1e-9 * tie, tuple(bounds))
    if fewest is None:
        return bounds if start is not None else None
    return [*bounds, (counts, _total(counts, fewest) + 0.5)]


def _total(v: np.ndarray, x: np.ndarray) -> float:
    """``v @ x`` for a 0/1 solution, summed exactly (``math.fsum``): a BLAS dot product adds
    in an order that depends on the CPU's kernel, so its last bit differs between machines,
    and plan files and tie-breaks must not."""
    return math.fsum(float(v[i]) for i in np.flatnonzero(np.round(x) > 0.5))


def _model_dtype_bytes(graph: OpGraph) -> int:
    for p in graph.model.parameters():
        return p.element_size()
    return 4


def _solution(prog: _Program, x: np.ndarray, time, params, memory) -> Solution:
    x = np.round(x)
    chosen: dict[int, Strategy] = {}
    for col in np.flatnonzero(x > 0.5):  # columns ascend in program order, so chosen does too
        key = prog.col_key[col]
        if key is not None:
            chosen[key[0]] = prog.strategies[key[0]][key[1]]
    placements = {op.output: chosen[op.index].output for op in prog.graph.ops if op.output is not None and chosen[op.index].output}
    # a folded copy's outputs are its representative's: code after the copy (a final norm
    # the check stands in for) reads them as the plan places those
    placements.update({v: placements[w] for v, w in _aliases(prog.graph).items() if w in placements and v not in placements})
    entries = {key: bool(x[col] > 0.5) for key, col in prog.entry_of.items()}
    return Solution(chosen, placements, entries, _total(time, x), _total(params, x), _total(memory, x))


def _no_strategy_message(op: Op, ctx: SolveContext, graph: OpGraph) -> str:
    forced = ctx.forced.get(op.index)
    if isinstance(forced, tuple):
        return (f"{op.target!r} cannot take style {forced[0]!r} with layouts {forced[1]} at tp={ctx.tp}: no strategy "
                "of that style has them (or a dimension it splits does not divide)")
    if forced and op.kind == "module" and op.target in read_elsewhere(graph):
        return (f"{op.target!r} cannot take style {forced!r}: other code reads its weight as a tensor too (a tied "
                "head) and cannot run on that split of it; pin a style that splits the rows that code keeps "
                "(an embedding's 'embedding_rowwise'), 'replicate', or drop the pin")
    if forced == "moe_whole_experts" and op.kind == "module" and op.module_kind == "experts":
        return (f"{op.target!r} cannot take style 'moe_whole_experts' at tp={ctx.tp}: that style takes a bank of E "
                f"experts, E divisible by {ctx.tp}, called with its routing (hidden, top_k_index, top_k_weights), with "
                "rows sorted by expert and their counts, or on every token once per expert [E T, H]"
                + ("" if ctx.whole_experts else ", on a mesh without an ep axis") + "; pin it to 'moe_tp_experts'")
    if forced:
        return f"{op.target!r} cannot take style {forced!r} at tp={ctx.tp}: a dimension it splits is not divisible by {ctx.tp}"
    return f"op {op.target!r} in {op.owner or 'the top level'!r} has no valid placement at tp={ctx.tp}"


def _budget_message(b: MilpView, memory: np.ndarray, ctx: SolveContext) -> str:
    least = b.minimize(b.scaled(memory))
    if least is None:  # nothing is valid at all (a pinned style that cannot be placed)
        return f"no valid tensor-parallel plan at tp={ctx.tp} with the styles pinned; unpin them or change tp"
    reach = _total(memory, least)
    fit = _fitting_tp(reach, ctx)
    return (
        f"memory budget {cost.format_bytes(ctx.memory_budget)} per device cannot be met at tp={ctx.tp}: "
        f"the least any plan reaches is {cost.format_bytes(reach)}. "
        + (f"tp={fit} would fit (estimated); " if fit else "")
        + "raise --memory-budget, add devices to the tp axis, or shrink batch/sequence."
    )


def _fitting_tp(reach: float, ctx: SolveContext) -> int | None:
    """Rough: the sharded part of memory scales as 1/tp."""
    for tp in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if tp > ctx.tp and reach * ctx.tp / tp <= ctx.memory_budget:
            return tp
    return None
