"""Experts: expert parallelism over an ``ep`` mesh axis, written into a solved plan and priced.

Contract
--------
``expert_parallel(plan, graph, ctx, solution)`` takes the plan the tensor-parallel program
chose for a mesh with an ``ep`` axis (``plan.mesh.ep_axis``) and returns it with every expert
bank the model calls with its routing (``bank(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])``, Hugging Face's routed banks; rows sorted by expert with their counts,
torchtitan's; every token once per expert, pre-scaled, ``bank(rows [E T, H])``, Llama 4's),
and every ``nn.ModuleList`` of experts its layer calls after a router (:func:`listed_banks`),
written ``ep_experts`` (``num_experts``
E, whole experts over ep; with a tp axis, ``inner: moe_tp_experts`` where the program split
the bank inside), and its estimate redone from the solution's per-device bytes: the banks'
parameters, gradients and optimizer state divided by ep (and sharded over the data axes
outside ep under FSDP, each bank its own unit); per bank call the count exchange and two row
exchanges forward, two backward, all-to-all on the ep axis's link; the dispatch buffers in
the activations. Every other module treats ep as a data axis: each rank its own tokens, dense
parameters sharded over the data axes and ep together. A bank not called with its routing
(a shared expert written as a bank) stays as the program planned it, with a warning.

Routing is priced as uniform (each rank sends and receives ``T k`` rows of ``H``); the
apply stage (:mod:`shardplan.apply.experts_ep`) exchanges whatever the router chose. Errors
name what was given: a mesh with ep but no routed bank (the shapes a bank was called with,
when there is one), an ep that does not divide E. Names and numbers only: no process group.
"""

from __future__ import annotations

from collections import Counter

from . import cost
from ..analyze.graph import OpGraph
from ..plan.model import Collectives, Estimate, Plan, Rule, matches
from .assemble import pattern_map, patterned
from .banks import Bank, expert_count, inside, listed_banks, routed_banks
from .estimate import _representative, entry_events, unit_param_bytes
from .regions import find_regions
from .fsdp import data_parallel_events, fsdp_units, unit_of
from .solve import PlanningError, Solution, SolveContext, _model_dtype_bytes, upkeep_time, work_time

__all__ = ["expert_parallel", "uniform_routing", "expert_count"]


def expert_parallel(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Solution) -> Plan:
    """The plan with its routed banks over ``plan.mesh.ep_axis``; see the module docstring.
    ``solution`` is the tensor-parallel program's, whose per-device bytes the estimate redoes."""
    axis, ep = plan.mesh.ep_axis, plan.ep
    unread: list[str] = []
    banks = _checked_banks(graph, plan, axis, ep, unread)
    rules = [_ep_rule(rule, banks, ep, axis) for rule in plan.rules] + _list_rules(graph, banks, ep, axis)
    notes = [f"{u.split(':')[0]}: kept as the tensor-parallel plan has it, a data-parallel module on {axis} "
             f"({u.split(': ', 1)[1]}, not a routed bank: bank(hidden [T, H], top_k_index [T, k], top_k_weights "
             "[T, k]))" for u in unread]
    return plan.model_copy(update={"rules": rules, "estimate": _estimate(plan, graph, ctx, solution, banks),
                                   "warnings": list(plan.warnings) + notes})


def uniform_routing(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Solution) -> Plan:
    """A plan without ep whose experts are a list: its estimate with each expert on ``T k / E``
    rows (uniform routing, as ep plans are priced) instead of the upper bound, every row."""
    banks = listed_banks(graph)
    if not banks:
        return plan
    old = plan.estimate
    counts = {phase: dict(c) for phase, c in old.collectives.items()}
    logical = dict(old.collective_bytes)
    compute, time, nbytes = _listed_runs(plan, graph, ctx, solution, banks, counts, logical, ep=1)
    note = (f"{', '.join(sorted({b.module for b in banks}))}: each expert priced on T k / E rows (uniform routing, "
            "k from the layer's topk), not on every row")
    return plan.model_copy(update={"warnings": list(plan.warnings) + [note], "estimate": old.model_copy(update={
        "step_time_s": old.step_time_s + compute + time, "compute_time_s": old.compute_time_s + compute,
        "comm_time_s": old.comm_time_s + time, "comm_bytes_per_step": old.comm_bytes_per_step + nbytes,
        "collectives": {phase: Collectives(**c) for phase, c in counts.items()},
        "collective_bytes": logical})})


def _checked_banks(graph: OpGraph, plan: Plan, axis: str, ep: int, unread: list[str]) -> list[Bank]:
    banks = routed_banks(graph, unread=unread) + listed_banks(graph, unread=unread)
    if not banks and unread:
        raise PlanningError(
            f"mesh has {axis}={ep}, but no expert bank of {type(graph.model).__name__} is called with its routing "
            f"({unread[0]}); expert parallelism needs bank(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) "
            "(Hugging Face's Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss) or bank(num_tokens_per_expert [E], rows sorted "
            "by expert [N, H]) (torchtitan's); plan it on tp, where its experts are split inside")
    if not banks:
        raise PlanningError(f"mesh has {axis}={ep}, but {type(graph.model).__name__} has no expert bank (a module of "
                            f"3-D [E, ...] weights called with the router's choice, or an nn.ModuleList of E alike "
                            f"experts after a router Linear of E outputs; 3-D parameters the layer's own code reads, "
                            f"`self.w1[e]` or an einsum, are neither); drop {axis!r}, or name those ranks 'dp'")
    for b in banks:
        if b.experts % ep:
            divisors = [d for d in range(2, b.experts + 1) if b.experts % d == 0]
            raise PlanningError(f"{b.module} has {b.experts} experts, which {axis}={ep} does not divide; use an "
                                f"{axis} of {divisors}")
    return banks


def _list_rules(graph: OpGraph, banks: list[Bank], ep: int, axis: str) -> list[Rule]:
    """One rule per kind of expert list (``layers.*.moe.experts``); the experts' own Linears
    keep the rules the tensor-parallel program gave them (split inside over tp, or whole)."""
    pmap, out = pattern_map(graph), {}
    for b in (b for b in banks if b.listed):
        why = (f"whole experts over {axis} ({b.experts // ep} of {b.experts} modules per rank); the layer's code runs "
               f"twice, recording its expert calls, then replaying their outputs: each call sends and receives "
               f"about {b.tokens * b.top_k * b.hidden} elements by all-to-all, priced as uniform routing")
        for name in patterned(b.module, graph, pmap):
            out[name] = Rule(module=name, style="ep_experts", num_experts=b.experts, why=why)
    return list(out.values())


def _ep_rule(rule: Rule, banks: list[Bank], ep: int, axis: str) -> Rule:
    bank = next((b for b in banks if not b.listed and matches(rule.module, b.module)), None)
    if bank is None:
        return rule
    inner = "moe_tp_experts" if rule.style == "moe_tp_experts" else None  # as the tensor-parallel program chose
    why = (f"whole experts over {axis} ({bank.experts // ep} of {bank.experts} per rank"
           f"{', split inside over tp' if inner else ''}); each call sends and receives about {bank.tokens * bank.top_k * bank.hidden} elements "
           "by all-to-all, priced as uniform routing")
    return Rule(module=rule.module, style="ep_experts", num_experts=bank.experts, inner=inner,
                output_layouts=rule.output_layouts if inner else None, why=why)


def _estimate(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Solution, banks: list[Bank]) -> Estimate:
    old, ep = plan.estimate, plan.ep
    width = cost.dtype_bytes(ctx.dtype)
    scale = width / _model_dtype_bytes(graph)
    counts = {phase: dict(c) for phase, c in old.collectives.items()}
    logical = dict(old.collective_bytes)
    a2a_time, a2a_bytes, buffers = _all_to_alls(plan, ctx, banks, counts, logical)
    held, lists = _held_banks(graph, solution, banks)  # copy -> bytes per device before ep
    bank_bytes = sum(held.values())
    before, after, counts["data_parallel"], logical["data_parallel"] = _data_parallel(plan, graph, ctx, solution, held, scale, lists)
    state = cost.training_bytes_per_param(dtype=ctx.dtype, optimizer=getattr(ctx.opts, "optimizer", "adamw")) / (
        _model_dtype_bytes(graph))
    peak = (old.peak_memory_bytes - bank_bytes * state / ctx.state_shards
            + bank_bytes / ep * state / _expert_state_shards(plan) + buffers * scale)
    runs = _listed_runs(plan, graph, ctx, solution, banks, counts, logical, ep=ep)
    comm_time = a2a_time + after[0] - before[0] + runs[1]
    return Estimate(
        param_bytes_per_device=old.param_bytes_per_device - bank_bytes * (1 - 1 / ep),
        peak_memory_bytes=peak,
        comm_bytes_per_step=old.comm_bytes_per_step + a2a_bytes + after[1] - before[1] + runs[2],
        step_time_s=old.step_time_s + comm_time + runs[0], compute_time_s=old.compute_time_s + runs[0],
        comm_time_s=old.comm_time_s + comm_time,
        collectives={phase: Collectives(**c) for phase, c in counts.items() if c or phase != "data_parallel"},
        collective_bytes={k: v for k, v in logical.items() if k in counts and (counts[k] or k != "data_parallel")},
    )


def _listed_runs(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Solution, banks: list[Bank],
                 counts: dict, logical: dict, *, ep: int) -> tuple[float, float, float]:
    """(compute, comm time, comm bytes) added for lists of experts, their counts and logical
    bytes updated in place. The tensor-parallel program runs every expert of a list on the
    upper bound of its rows (``T k``, every row routed to it); priced as uniform routing, each
    rank runs each of its E/ep experts once per call on ``ep T k / E`` rows, and over ep
    (``ep > 1``) its layer's other ops run forward twice (the record pass; its backward is
    the rows' indexing only)."""
    total = [0.0, 0.0, 0.0]
    for b in (b for b in banks if b.listed):
        layer = b.module.rpartition(".")[0]
        ops = {op.index for op in graph.ops if op.target.startswith(f"{b.module}.") or op.owner.startswith(f"{b.module}.")}
        rows = ep / b.experts
        for (phase, k, n, _), times in _entry_events(graph, solution, ops).items():
            _rescale(total, counts, logical, ctx, (phase, k, n), times, times // ep, rows)
        for op in graph.ops:
            s = solution.strategies[op.index]
            if op.index in ops:
                runs = op.multiplicity // ep
                total[0] += work_time(s, ctx) * (rows * runs - op.multiplicity) + upkeep_time(s, ctx) * (
                    runs - op.multiplicity)
                events = [("forward", k, n) for k, n in s.fwd] + [("backward", k, n) for k, n in s.bwd]
                for event in events + [(phase, k, n) for phase, k, n, _ in s.group_comms]:
                    _rescale(total, counts, logical, ctx, event, op.multiplicity, runs, rows)
            elif ep > 1 and op.kind in ("module", "function") and inside(op.target if op.kind == "module" else op.owner, layer):
                total[0] += work_time(s, ctx) / 3 * op.multiplicity  # forward: 1 of the 3 matmuls of a step
                for k, n in s.fwd:
                    _rescale(total, counts, logical, ctx, ("forward", k, n), 0, op.multiplicity, 1.0)
    return total[0], total[1], total[2]


def _rescale(total: list[float], counts: dict, logical: dict, ctx: SolveContext, event: tuple, was: int, runs: int,
             rows: float) -> None:
    """``was`` collectives ``event`` (phase, kind, bytes) become ``runs`` of ``rows`` times the bytes."""
    phase, kind, n = event
    for times, size in ((runs, n * rows), (-was, n)):
        t, m = _bump(counts, logical, ctx, phase, kind, size, times)
        total[1], total[2] = total[1] + t, total[2] + m


def _entry_events(graph: OpGraph, solution: Solution, ops: set[int]) -> Counter:
    """The collectives of the regions whose readers are all in ``ops`` (an input gathered
    once for an expert's Linears, its gradient reduced), as :func:`.estimate.collective_list`
    counts them: ``(phase, kind, bytes, group) -> times``."""
    out: Counter = Counter()
    for e in find_regions(graph, solution):
        if set(e.consumers) <= ops:
            out.update(entry_events(graph, e))
    return out


def _bump(counts: dict, logical: dict, ctx: SolveContext, phase: str, kind: str, n: float, times: float):
    """``times`` (negative: fewer) more ``kind`` collectives of ``n`` bytes on tp: (seconds, bytes)."""
    counts.setdefault(phase, {})
    counts[phase][kind] = counts[phase].get(kind, 0) + times
    logical[phase] = logical.get(phase, 0.0) + n * times
    return (cost.collective_time(kind, n, group_size=ctx.tp, link=ctx.link) * times,
            cost.collective_bytes(kind, n, group_size=ctx.tp) * times)


def _all_to_alls(plan: Plan, ctx: SolveContext, banks: list[Bank], counts: dict, logical: dict):
    """Per bank call: the count exchange and the rows there, forward; the rows back, and both
    again in backward: each rank sends and receives ``T k`` rows (uniform routing)."""
    link = cost.axis_links(ctx.hardware, plan.mesh.axes)[plan.mesh.ep_axis]
    width = cost.dtype_bytes(ctx.dtype)
    time = nbytes = buffers = 0.0
    for b in banks:
        rows = b.tokens * b.top_k * b.hidden * width
        for phase, n in [("forward", b.experts * 8)] + [("forward", rows)] * 2 + [("backward", rows)] * 2:
            counts.setdefault(phase, {})
            counts[phase]["all_to_all"] = counts[phase].get("all_to_all", 0) + b.calls
            logical[phase] = logical.get(phase, 0.0) + n * b.calls
            time += cost.collective_time("all_to_all", n, group_size=plan.ep, link=link) * b.calls
            nbytes += cost.collective_bytes("all_to_all", n, group_size=plan.ep) * b.calls
        buffers += (2 * rows + b.tokens * b.top_k * 8) * b.calls  # send and receive rows, the order
    return time, nbytes, buffers


def _held_banks(graph: OpGraph, solution: Solution, banks: list[Bank]) -> tuple[dict[str, float], set[str]]:
    """Every routed bank module (folded copies too) -> its parameter bytes per device as the
    tensor-parallel solution holds them (split inside by moe_tp_experts, or whole); for a
    list of experts, every expert module (``moe.experts.3``) -> its weight modules' bytes.
    Also the lists' names."""
    planned = {op.target: solution.strategies[op.index] for op in graph.ops if op.kind == "module"}
    reps = {fqn: _representative(fqn, graph.traced.folded) for fqn, _ in graph.model.named_modules()}
    held = {fqn: planned[rep].param_bytes for fqn, rep in reps.items() if rep in {b.module for b in banks if not b.listed}}
    lists = _list_copies(reps, banks)
    for fqn, rep in reps.items():
        expert = next((f"{b}.{fqn[len(b) + 1:].split('.')[0]}" for b in lists if fqn.startswith(f"{b}.")), None)
        if expert is not None and rep in planned:
            held[expert] = held.get(expert, 0.0) + planned[rep].param_bytes
    return held, set(lists)


def _list_copies(reps: dict[str, str], banks: list[Bank]) -> list[str]:
    """Every expert list of the model, folded copies too."""
    listed = {b.module for b in banks if b.listed}
    return [fqn for fqn, rep in reps.items() if rep in listed]


def _data_axes(plan: Plan, *, with_ep: bool) -> dict[str, int]:
    return {a: n for a, n in plan.mesh.axes.items()
            if a != plan.mesh.tp_axis and (with_ep or a != plan.mesh.ep_axis) and n > 1}


def _expert_state_shards(plan: Plan) -> int:
    """Under FSDP the banks shard over the last data axis outside ep (HSDP replicates the others)."""
    axes = list(_data_axes(plan, with_ep=False).values())
    return axes[-1] if axes and plan.options.data_parallel == "fsdp" else 1


def _events(unit_bytes, axes: dict[str, int], plan: Plan, ctx: SolveContext):
    links = cost.axis_links(ctx.hardware, plan.mesh.axes)
    return data_parallel_events(unit_bytes, axes, links, mode=plan.options.data_parallel) if axes else []


def _totals(events) -> tuple[float, float, dict[str, int], float]:
    time = nbytes = logical = 0.0
    counts: dict[str, int] = {}
    for e in events:
        counts[e.kind] = counts.get(e.kind, 0) + e.times
        logical += e.nbytes * e.times
        time += cost.collective_time(e.kind, e.nbytes, group_size=e.group_size, link=e.link) * e.times
        nbytes += cost.collective_bytes(e.kind, e.nbytes, group_size=e.group_size) * e.times
    return time, nbytes, counts, logical


def _rank_units(held: dict[str, float], ep: int, lists: set[str]) -> list[tuple[str, float]]:
    """A rank's expert units and their bytes: 1/ep of each bank; of a list of E experts, the
    E/ep it holds whole (priced as the first E/ep: they are alike)."""
    out = []
    for fqn, n in held.items():
        head = fqn.rpartition(".")[0]
        if head not in lists:
            out.append((fqn, n / ep))
            continue
        members = [f for f in held if f.rpartition(".")[0] == head]  # in the container's order
        if members.index(fqn) < len(members) // ep:
            out.append((fqn, n))
    return out


def _data_parallel(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Solution, held: dict[str, float],
                   scale: float, lists: set[str]):
    """The data axes' collectives as the plain estimate priced them (every unit over the data
    axes and ep), and as they run: dense units over the data axes and ep, each bank its own
    unit over the data axes outside ep, as its block reshards."""
    units = fsdp_units(plan.model.repeats, graph.model)
    sizes = unit_param_bytes(graph, solution, units)
    before = _totals(_events([(sizes[u] * scale, r) for u, r in units], _data_axes(plan, with_ep=True), plan, ctx))
    for fqn, n in held.items():
        sizes[unit_of(fqn, units)] -= n
    reshard = dict(units)
    dense = _events([(sizes[u] * scale, r) for u, r in units], _data_axes(plan, with_ep=True), plan, ctx)
    experts = _events([(n * scale, reshard[unit_of(fqn, units)]) for fqn, n in _rank_units(held, plan.ep, lists)],
                      _data_axes(plan, with_ep=False), plan, ctx)
    time, nbytes, counts, logical = _totals(dense + experts)
    return before[:2], (time, nbytes), counts, logical
