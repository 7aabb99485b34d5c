"""Public API: ``plan_model`` (decide), ``apply_plan`` (apply), ``auto_parallelize`` (both).

Contract
--------
``plan_model(model, mesh, *, example_inputs=None, **options) -> Plan`` traces the model on
meta tensors, builds the op graph, solves the placement program and returns the plan as
data. It never needs a process group: ``mesh`` may be a ``DeviceMesh`` or axis sizes
(``{"tp": 8}``, ``{"dp": 16, "tp": 8}``); tensor parallelism runs on the axis named
``tp`` (else the last axis that is not a data axis). The other axes must be data axes
(:data:`DATA_AXES`); any other axis larger than 1 (``pp``, ``cp``, ``ep``) is a
``ValueError``, since nothing would price it. Same model, mesh and options -> byte-identical plan.

``plan_model(model, world_size=N)`` (and :func:`compare_meshes`, which returns every
candidate) plans each ``{"dp": N // tp, "tp": tp}`` split, tracing once, and picks the one
with the most samples per second (``dp * batch / step_time_s``) whose predicted peak memory
fits the budget (``memory_budget``, else the hardware's device memory). The chosen plan is
byte-identical to ``plan_model(model, that_split)`` with the same options.

``explain`` (default ``True``) prices each module's rejected styles by re-solving;
``False`` skips that, and a module name (``explain="layers.0.attention.wq"``) prices only
the rule covering it.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from .decide import cost
from .decide.estimate import estimate
from .decide.explain import explain_decisions
from .analyze.frontend import op_graph
from .analyze.graph import OpGraph
from .analyze.snapshot import preserved
from .decide import assemble, shortfalls
from .decide.axes import DATA_AXES, check_axes, expert_axis, mesh_axes, state_shards, tp_axis_of  # noqa: F401 - mesh_axes re-exported
from .decide.experts import expert_count, expert_parallel, uniform_routing
from .apply.localcheck import LocalShapeError, check_local_shapes
from .apply.localsizes import find_local_attributes
from .apply.standins import OuterCodeError, check_outer_code, stood_blocks
from .plan.model import MeshInfo, ModelInfo, Plan, PlanOptions, fingerprint, matches
from .decide.regions import find_handovers, find_partial_blocks, find_regions, handover_regions
from .decide.mixing import mixing_warnings
from .decide.slices import inner_cuts
from .decide.solve import PlanningError, SolveContext, solve
from .decide.splits import MeshCandidate, MeshComparison, choose, dp_tp_splits, ep_splits
from .analyze.trace import TraceError, trace_model

__all__ = [
    "plan_model", "apply_plan", "auto_parallelize", "price_styles", "mesh_axes", "compare_meshes", "MeshComparison",
    "MeshCandidate", "DATA_AXES", "PlanningError", "TraceError",
]

_EXTRA_OPTIONS = ("explain", "tp_axis", "fold_repeated", "strict", "check", "front_end", "_pinned")
_OPTION_NAMES = set(PlanOptions.model_fields) | set(_EXTRA_OPTIONS)


def infer_example_inputs(model: nn.Module, *, batch_size: int, seq_len: int) -> tuple:
    """Token ids for models that start with an Embedding, features for ones that start with a Linear."""
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear, nn.modules.conv._ConvNd))), None)
    table = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(first, nn.Linear) and table is not None and first.in_features == table.embedding_dim:
        first = table  # a head registered before the token table (litgpt's lm_head): reads its width
    if isinstance(first, nn.modules.conv._ConvNd):
        raise ValueError(
            f"cannot infer example inputs for {type(model).__name__}: it starts with a {type(first).__name__} "
            f"({first.in_channels} channels), whose input size it does not say; pass example_inputs=(tensor, ...) "
            "shaped like a real batch (from the command line: return (model, example_inputs) from the callable)"
        )
    required = [p.name for p in inspect.signature(model.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise ValueError(
            f"cannot infer example inputs for {type(model).__name__}: forward() takes {len(required)} inputs "
            f"({', '.join(required)}); pass example_inputs=(tensor, ...) for them (from the command line: return "
            "(model, example_inputs) from the callable)"
        )
    if isinstance(first, nn.Embedding):
        # real token ids (CPU, fixed seed), which the tracer reads where forward branches on
        # them; for a meta model only their shapes go meta
        gen = torch.Generator().manual_seed(0)
        high = min(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))  # valid in every table
        return (torch.randint(0, high, (batch_size, seq_len), generator=gen, device="cpu"),)
    if isinstance(first, nn.Linear):
        return (torch.zeros(batch_size, first.in_features, device="meta"),)
    raise ValueError(
        f"cannot infer example inputs for {type(model).__name__}: its first weight module is "
        f"{type(first).__name__ if first else 'missing'}; pass example_inputs=(tensor, ...) shaped like a real batch"
    )


_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
                  "block_size")  # nanoGPT's and litgpt's config; x-transformers' model keeps max_seq_len


def _max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's own config allows (a RoPE table or a position
    embedding that long), read from ``model.config`` (Hugging Face, shardplan's presets) or
    torchtitan's ``model.model_args``: the default example stays within it."""
    for cfg in (getattr(model, "config", None), getattr(model, "model_args", None), getattr(model, "params", None), model):
        for key in _POSITION_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return _table_positions(model)


# where a user's own model keeps its positions, with no config to say how many: minGPT's
# ``pos_emb`` Parameter [1, L, D], nanoGPT's ``wpe``, the PyTorch tutorial's ``pe`` buffer,
# Meta's llama ``freqs_cis`` [L, hd / 2]
_POSITION_TABLES = frozenset({"wpe", "pe", "pos", "pos_emb", "pos_embed", "pos_embedding", "pos_embeddings",
                              "position_embedding", "position_embeddings", "positional_embedding", "freqs_cis"})


def _table_positions(model: nn.Module) -> int | None:
    """The fewest positions any table named as one holds (its rows: an ``nn.Embedding``'s
    ``num_embeddings``, a tensor's longest dim before its features, ``[1, L, D]`` or the
    tutorial's time-major ``[L, 1, D]``), or None."""
    found = [m.num_embeddings for name, m in model.named_modules()
             if isinstance(m, nn.Embedding) and name.rpartition(".")[2] in _POSITION_TABLES]
    found += [max(t.shape[:-1]) for name, t in [*model.named_parameters(), *model.named_buffers()]
              if name.rpartition(".")[2] in _POSITION_TABLES and t.dim() >= 2]
    return min(found, default=None) or None


def _options(opts: dict[str, Any]) -> tuple[PlanOptions, dict[str, Any]]:
    unknown = sorted(set(opts) - _OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown plan_model option(s) {unknown}; expected some of {sorted(_OPTION_NAMES)}")
    extra = {k: opts.pop(k) for k in _EXTRA_OPTIONS if k in opts}
    if isinstance(opts.get("memory_budget"), str):
        opts["memory_budget"] = cost.parse_bytes(opts["memory_budget"])
    if "dtype" in opts:
        cost.dtype_bytes(opts["dtype"])
    try:
        return PlanOptions(**opts), extra
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"plan_model option {name}={err.get('input')!r}: {err['msg']}") from None


def plan_model(
    model: nn.Module, mesh: Any = None, *, example_inputs: tuple | None = None, example_kwargs: dict | None = None,
    world_size: int | None = None, **options: Any,
) -> Plan:
    """Decide the tensor-parallel plan of ``model`` on ``mesh``, or on the best dp x tp split
    of ``world_size`` devices; see the module docstring."""
    if world_size is not None or mesh is None:
        if mesh is not None:
            raise ValueError(f"plan_model got both a mesh and world_size={world_size!r}; give the mesh to plan on "
                             "it, or world_size alone to let the planner choose the dp x tp split")
        if world_size is None:
            raise ValueError("plan_model needs a mesh (axis sizes like {'tp': 8} or a DeviceMesh) or world_size=N "
                             "to choose the dp x tp split of N devices")
        return compare_meshes(model, world_size, example_inputs=example_inputs, example_kwargs=example_kwargs,
                              **options).plan
    with preserved(model, values=True):  # planning runs forward, whose code may cache on the model: never left there
        _check_model(model)
        opts, extra = _options(dict(options))
        axes = mesh_axes(mesh)
        tp_axis = tp_axis_of(axes, extra.get("tp_axis"))
        if tp_axis is None:  # data and expert axes only: no tensor parallelism, written tp: 1
            axes, tp_axis = {**axes, "tp": 1}, "tp"
            mesh = axes
        check_axes(axes, tp_axis)
        _check_tp_size(model, axes[tp_axis])
        opts, example_inputs = _defaults(model, opts, example_inputs)
        graph = _graph(model, example_inputs, example_kwargs, extra)
        return _plan_on(model, graph, axes, tp_axis, opts, extra, mesh=mesh, example_inputs=example_inputs)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"plan_model needs an nn.Module; got {type(model).__name__} {model!r:.60}. Build the model "
                         "first (on the meta device it costs no memory), e.g. shardplan.models.build_preset('mlp')")


def _defaults(model: nn.Module, opts: PlanOptions, example_inputs: Any) -> tuple[PlanOptions, tuple]:
    """The model's dtype when none is given, and example inputs as a tuple (inferred if absent)."""
    cost.get_hardware(opts.hardware)  # an unknown profile fails before the trace
    if opts.dtype is None:
        opts = opts.model_copy(update={"dtype": _model_dtype(model)})
    if example_inputs is None:
        # the CLI's presets default to batch 2 as well: one model, one default shape
        seq_len = opts.seq_len or min(2048, _max_positions(model) or 2048)
        example_inputs = infer_example_inputs(model, batch_size=opts.batch_size or 2, seq_len=seq_len)
    elif not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return opts, example_inputs


def _graph(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, extra: dict[str, Any]) -> OpGraph:
    """The op graph: it depends on the model and inputs only, never on the mesh."""
    graph = op_graph(model, example_inputs, example_kwargs, front_end=extra.get("front_end", "auto"),
                     fold=extra.get("fold_repeated", True), tracer=trace_model)
    if not any(op.kind == "module" for op in graph.ops):
        raise PlanningError(f"{type(model).__name__} has no weight modules called in forward: nothing to shard")
    return graph


def _plan_on(model: nn.Module, graph: OpGraph, axes: dict[str, int], tp_axis: str, opts: PlanOptions,
             extra: dict[str, Any], *, mesh: Any, example_inputs: tuple) -> Plan:
    """Solve, assemble and check the plan of ``graph`` on ``axes`` (validated by the caller)."""
    if axes[tp_axis] == 1:  # nothing is split: no sequence or vocabulary shards either
        opts = opts.model_copy(update={"sequence_parallel": False, "loss_parallel": False})
    hardware = cost.get_hardware(opts.hardware)
    ctx = SolveContext(
        tp=axes[tp_axis], hardware=hardware, link=cost.axis_links(hardware, axes)[tp_axis],
        dtype=opts.dtype, memory_budget=opts.memory_budget, opts=opts,
        state_shards=state_shards(axes, tp_axis, opts.data_parallel),
        forced=_pin(graph, extra.get("_pinned") or {}) if axes[tp_axis] > 1 else _replicate_all(graph),
        whole_experts=expert_axis(axes, tp_axis) is None,
    )
    whole: dict[str, str] = {}  # module -> the plan's warning for running it whole (_kept_whole)
    attributes: list = []  # modules whose size attributes take their local value (a head count)
    views: list = []  # modules whose views spell a width read off a whole tensor (nanoGPT's view(B, T, C))
    notes: list[str] = []  # what the check made the planner give up (sequence parallel)
    handover = False  # sequence shards reach the blocks as DTensors (code between them reads their sizes)
    squeezed, pending, assembled = 0, None, None
    cut_seen: set[str] = set()  # modules whose inner cuts were looked for
    while True:
        solution, pending = pending or _solve_explained(graph, ctx), None
        if assembled is None or assembled[0] is not solution:  # local attributes found: same solution, same plan
            entries, blocks = find_regions(graph, solution), find_partial_blocks(graph, solution)
            assembled = (solution, entries, blocks, _assemble(
                model, graph, solution, ctx, entries, blocks, opts=_record_shapes(opts, example_inputs), axes=axes,
                tp_axis=tp_axis, strict=extra.get("strict", False), whole=whole))
        _, entries, blocks, base = assembled
        handed = handover_regions(find_handovers(graph, solution.placements, stood_blocks(graph))) if handover else []
        plan = base.model_copy(update={"attributes": list(base.attributes) + list(attributes), "local_views": list(views),
                                       "regions": list(base.regions) + handed, "warnings": list(base.warnings) + notes})
        over = plan.estimate.peak_memory_bytes - opts.memory_budget if opts.memory_budget else 0
        if over > 0 and squeezed < 3:
            # the program prices activations per op, the estimate per transformer block
            # (Korthikanti): tighten the program's budget until the estimate holds too
            tighter = int(ctx.memory_budget - 1.01 * over)
            pending = _solve_or_none(graph, replace(ctx, memory_budget=tighter)) if tighter > 0 else None
            if pending is not None:
                squeezed += 1
                ctx.memory_budget = tighter
                continue
        try:
            if extra.get("check", True):
                check_local_shapes(graph, plan, _handed(graph, solution), mesh=mesh)
                unchecked = check_outer_code(graph, plan, _after_exits(solution), mesh=mesh)
                if unchecked:
                    plan.warnings.append(unchecked)
            cut = _next_inner_cuts(graph, solution, cut_seen, whole)
            if cut is None:
                break
            # a value the plan cuts inside a module's code, not yet found (its shards ran as
            # they were): find the call, or run that module whole
            found = find_local_attributes(graph, plan, _handed(graph, solution), cut[0], mesh=mesh, cuts=cut[1])
            if found:
                attributes, views, pending = attributes + found[0], views + found[1], solution
            else:
                whole[cut[0]] = _uncut(graph, *cut)
                ctx.forced = {**ctx.forced, **_run_whole(graph, cut[0], ctx)}
            continue
        except LocalShapeError as exc:
            if isinstance(exc, OuterCodeError) and not handover and _sequence_parallel(graph, solution):
                # positions or a mask made from the sequence-split embedding output: hand it on
                # as a DTensor, whose sizes are global (:func:`.decide.regions.find_handovers`)
                handover, pending = True, solution
                continue
            # its code sizes by a global count (a weight module then fails on what it was
            # handed: o_proj on twice its features): the local count makes its shards run
            found = find_local_attributes(graph, plan, _handed(graph, solution), exc.module, mesh=mesh,
                                          cuts=_inner_cuts_in(graph, solution, exc.module, cut_seen)) if (
                exc.module and exc.module != exc.leaf and len(attributes) + len(views) < 16) else None
            if found:
                attributes += found[0]
                views += found[1]
                pending = solution
                continue
            if exc.leaf is not None and exc.leaf not in whole and not extra.get("strict") and len(whole) < 16:
                # the module's own forward fails on its shards: that module stays whole
                whole[exc.leaf] = _kept_whole(graph, exc.leaf, exc)
                ctx.forced = {**ctx.forced, **_replicate_module(graph, exc.leaf)}
                continue
            # code between the blocks that hands a block a size read off sequence shards fails
            # whether or not that block runs whole: only dropping sequence parallel helps
            if (exc.module not in whole or isinstance(exc, OuterCodeError)) and _drop_sequence_parallel(
                    graph, solution, ctx, exc):
                # code that reads a size off a sequence-split tensor (``B, T, C = x.shape``
                # before the norm gathers x; positions from the embedding's output) sees T / tp
                where, said = (exc.module, str(exc).split(": ", 1)[1]) if exc.module is not None else (
                    type(model).__name__, str(exc))
                notes.append(f"{where}: sequence parallel off: no local size lets its shards run on "
                             f"sequence-split inputs (as written: {said.split('. The code')[0][:240]})")
                continue
            if (exc.module is None or exc.module in whole) and not extra.get("strict"):
                # it fails outside any weight-bearing submodule, or even with that module run
                # whole (masks, routing): not a sharding problem the check can fix; say so
                plan.warnings.append(f"local shape check skipped: {str(exc)[:300]}")
                break
            if extra.get("strict") or len(whole) >= 16:
                raise
            # its code uses a global size: let it see whole tensors, weights still sharded
            whole[exc.module] = _kept_whole(graph, exc.module, exc)
            ctx.forced = {**ctx.forced, **_run_whole(graph, exc.module, ctx)}
    if extra.get("explain", True):
        decisions = explain_decisions(
            graph, solution, ctx, modules=_explained(plan, model, graph, extra.get("explain", True)))
        plan = plan.model_copy(update={"decisions": decisions, "rules": assemble.rules(
            graph, solution, decisions, entries, blocks)})
    # copies export could not fold, and raw-weight blocks a ModuleList holds as leaves (each
    # one op, run whole on DTensors): one rule per kind of block
    if graph.traced.front_end == "export" or any(r.style == "dtensor_weights" for r in plan.rules):
        merged, decisions = assemble.merge_repeated(plan.rules, plan.decisions, model)
        plan = plan.model_copy(update={"rules": merged, "decisions": decisions})
    plan = _with_experts(plan, graph, ctx, solution) if plan.mesh.ep_axis else uniform_routing(plan, graph, ctx, solution)
    mixing = mixing_warnings(graph, axes, tp_axis)  # routing that each data-parallel rank does on its own rows
    return plan.model_copy(update={"warnings": list(plan.warnings) + mixing}) if mixing else plan


def compare_meshes(model: nn.Module, world_size: int, *, example_inputs: tuple | None = None,
                   example_kwargs: dict | None = None, **options: Any) -> MeshComparison:
    """Plan ``model`` on every ``{"dp": world_size // tp, "tp": tp}`` split, tracing once, and
    choose the one with the most samples per second whose predicted peak memory fits
    (``memory_budget``, else the hardware's device memory); see :mod:`.decide.splits`. Options
    are ``plan_model``'s, except ``tp_axis``."""
    _check_model(model)
    splits = dp_tp_splits(world_size)
    opts, extra = _options(dict(options))
    if "tp_axis" in extra:
        raise ValueError("tp_axis does not apply with world_size: the splits' axes are named 'dp' and 'tp'; "
                         "plan on a mesh of your own axes instead")
    _check_tp_size(model, 1)  # a model with no parameters has nothing to compare
    if extra.get("check", True) and torch.distributed.is_available() and torch.distributed.is_initialized():
        # each split's local check needs a fake group of its tp, which cannot be made under
        # a real one; refuse rather than let the process group decide the table
        raise PlanningError("world_size planning checks each split on a temporary fake process group, which cannot "
                            "be made while a process group exists; plan before init_process_group (or on one process "
                            "and save the plan), or pass check=False")
    opts, example_inputs = _defaults(model, opts, example_inputs)
    hardware = cost.get_hardware(opts.hardware)
    limit = opts.memory_budget or hardware.memory_bytes
    source = "memory budget" if opts.memory_budget else f"{hardware.name}'s device memory"
    with preserved(model, values=True):  # as in plan_model
        graph = _graph(model, example_inputs, example_kwargs, extra)
        splits = splits + ep_splits(world_size, expert_count(graph))  # a MoE model: experts over ep too
        quick = {**extra, "explain": False}  # explain only the chosen split: its re-solves are most of the time
        candidates = [_candidate(model, graph, axes, opts, quick, example_inputs, limit) for axes in splits]
        chosen, best = choose(candidates), None
        if chosen is not None:
            best = candidates[chosen].plan
            if extra.get("explain", True):
                axes = candidates[chosen].axes
                best = _plan_on(model, graph, axes, "tp", opts, extra, mesh=axes, example_inputs=example_inputs)
    return MeshComparison(world_size=world_size, memory_limit=int(limit), limit_source=source,
                          candidates=candidates, chosen=chosen, plan_of_chosen=best)


def _candidate(model, graph, axes, opts, extra, example_inputs, limit) -> MeshCandidate:
    try:
        _check_tp_size(model, axes["tp"])
    except ValueError as exc:  # a tp beyond every weight dimension: listed, not planned
        return MeshCandidate(axes=axes, plan=None, error=str(exc))
    try:
        plan = _plan_on(model, graph, axes, "tp", opts, extra, mesh=axes, example_inputs=example_inputs)
    except PlanningError as exc:  # no plan at this tp (strict, sequence parallel, ...); others may have one
        return MeshCandidate(axes=axes, plan=None, error=str(exc))
    return MeshCandidate(axes=axes, plan=plan, fits=plan.estimate.peak_memory_bytes <= limit)


def _explained(plan: Plan, model: nn.Module, graph: OpGraph, explain: Any = True):
    """Which rule names explain prices: the one module asked for (``explain="layers.0.wq"``),
    or on an unfolded export graph the block each merged rule keeps; ``None``: every one."""
    if isinstance(explain, str):
        return lambda name: matches(name, explain) or matches(explain, name)
    if graph.traced.front_end == "export":
        return assemble.merged_representatives(plan.rules, model).__contains__
    return None


def _solve_explained(graph: OpGraph, ctx: SolveContext):
    """``solve``; when sequence parallel was asked for and no plan puts any norm on sequence
    shards, say which norms the model keeps whole rather than hand back a plan without it.
    (Norms that some plan can split are split; the others are warned about by name.)"""
    solution = solve(graph, ctx)
    if ctx.opts is None or ctx.opts.sequence_parallel is not True or _sequence_parallel(graph, solution):
        return solution
    kept = [op for op in graph.ops if op.kind == "module" and solution.strategies[op.index].off_sequence]
    norms = kept or [op for op in graph.ops if op.kind == "module" and op.module_kind == "norm"]
    shapes = [graph.values[v].shape for op in norms for v in op.inputs[:1] if v in graph.values and len(graph.values[v].shape) == 3]
    odd = [x for x in shapes if x[1] > 1 and x[1] % ctx.tp] if shapes and all(x[1] % ctx.tp for x in shapes) else []
    if not kept and not odd:  # (norms with no sequence-shard style at all: at odd lengths, said so)
        return solution
    names = ", ".join(op.target for op in norms[:3])
    why = (f"their sequence of {odd[0][1]} tokens, {list(odd[0])}, does not split {ctx.tp} ways: sequence parallel "
           "needs a length that tp divides" if odd else f"a value between them cannot be split along the sequence; {names} stay whole")
    if odd and odd[0][0] % ctx.tp == 0 and odd[0][0] > odd[0][1]:  # fairseq's [seq, batch, hidden]
        why += (f"; if the model runs sequence-first, its sequence is dim 0 ({odd[0][0]}), and sequence parallel "
                 "splits dim 1 of [batch, seq, hidden] only")
    raise PlanningError(
        f"sequence_parallel=True has no valid plan at tp={ctx.tp}: no placement puts any norm on sequence shards "
        f"({why}). Use sequence_parallel=None (--sequence-parallel auto) to let it choose"
    )


def _handed(graph: OpGraph, solution: Any) -> Any:
    """The solution's placements, and the conversions where modules return values, as the
    local check hands them to blocks outside those modules (a position-encoding module's
    output cut onto the first block's sequence shards)."""
    from .apply.localcheck import ExitPlacements
    from .decide.scatter import exits, is_cut, is_scatter, scatter_target

    found = exits(graph)
    moved = {v: (found[v].module, scatter_target(e)) for (v, e), used in solution.entries.items()
             if used and (is_cut(e) or is_scatter(e)) and v in found}
    return ExitPlacements(solution.placements, moved)


def _after_exits(solution: Any) -> dict[int, str]:
    """Placements as the code after a module sees them: a value reduce-scattered or cut onto
    sequence shards where its module returns is that shard for every reader."""
    from .decide.scatter import is_cut, is_scatter, scatter_target

    moved = {v: scatter_target(e) for (v, e), used in solution.entries.items() if used and (is_cut(e) or is_scatter(e))}
    return {**solution.placements, **moved}


def _sequence_parallel(graph: OpGraph, solution: Any) -> bool:
    """Activations between modules are split along the sequence: a norm module on sequence
    shards, or a weight module handing on or taking ``S(1)`` (OLMo's norms have no weights:
    the embedding's reduce-scatter and the projections' gathers are all that show it)."""
    from .decide.placements import shard_dim

    def on_sequence(p: str | None, v: int | None) -> bool:
        return bool(p) and shard_dim(p) == 1 and v in graph.values and len(graph.values[v].shape) >= 3

    for op in (op for op in graph.ops if op.kind == "module"):
        s = solution.strategies[op.index]
        if s.name == "sequence_parallel" or any(on_sequence(p, v) for p, v in zip((s.output, *s.inputs),
                                                                                   (op.output, *op.inputs))):
            return True
    return False


def _drop_sequence_parallel(graph: OpGraph, solution: Any, ctx: SolveContext, exc: LocalShapeError) -> bool:
    """Under ``sequence_parallel=None``, when the plan put a norm on sequence shards: the
    program no longer may (``ctx`` changed in place). True when it changed. Asked for
    (``True``), code between the blocks that cannot take sequence shards is an error."""
    if ctx.opts is None or ctx.opts.sequence_parallel is False:
        return False
    if not _sequence_parallel(graph, solution) and not isinstance(exc, OuterCodeError):
        return False  # (a value the code between the blocks hands on may be cut onto sequence shards alone)
    if ctx.opts.sequence_parallel is True:
        if exc.module is None:
            raise PlanningError(f"sequence_parallel=True: {exc}. Use sequence_parallel=None (--sequence-parallel auto) "
                                "to let the planner decide") from None
        return False
    ctx.opts = ctx.opts.model_copy(update={"sequence_parallel": False})
    return True


def _solve_or_none(graph: OpGraph, ctx: SolveContext):
    try:
        return solve(graph, ctx)
    except PlanningError:
        return None


def _run_whole(graph: OpGraph, module: str, ctx: SolveContext) -> dict[int, str]:
    """Pin the weights under ``module`` so its code sees whole tensors: Linears gather their
    outputs (their weights stay sharded), everything else is replicated."""
    from .decide.strategies import op_strategies

    pins = {}
    for op in graph.ops:
        if op.kind == "module" and (op.target == module or op.target.startswith(module + ".")):
            names = {s.name for s in op_strategies(op, graph, tp=ctx.tp, opts=ctx.opts)}
            pins[op.index] = "colwise_gather_output" if "colwise_gather_output" in names else "replicate"
    return pins


def _next_inner_cuts(graph: OpGraph, solution: Any, seen: set[str], whole: dict[str, str]) -> tuple[str, list] | None:
    """A module whose code the solution cuts a whole value in (:func:`.decide.slices.inner_cuts`)
    not yet looked at, with its cuts; marked seen."""
    for fqn, cuts in inner_cuts(graph, solution.strategies).items():
        if fqn not in seen and fqn not in whole:
            seen.add(fqn)
            return fqn, cuts
    return None


def _inner_cuts_in(graph: OpGraph, solution: Any, fqn: str | None, seen: set[str]) -> list:
    """The inner cuts of the modules at or under ``fqn`` not yet looked at, in trace order
    (the check failed in ``fqn``: its local views count the calls of the code under it); marked seen."""
    found = [] if not fqn else [(m, cuts) for m, cuts in inner_cuts(graph, solution.strategies).items()
                                if m not in seen and (m == fqn or m.startswith(fqn + "."))]
    seen.update(m for m, _ in found)
    return sorted((c for _, cuts in found for c in cuts), key=lambda c: (c.op, c.slot))


def _uncut(graph: OpGraph, fqn: str, cuts: list) -> str:
    from .analyze.trace import _user_line

    reads = ", ".join(f"`{graph.ops[c.op].target}` ({_user_line(graph.ops[c.op].node)})" for c in cuts[:2])
    return (f"{fqn}: runs on whole activations, its weights still sharded: its code makes a value read beside "
            f"values split tp ways ({reads}) that the check could not find whole where it is read, so it is not cut there")


def _kept_whole(graph: OpGraph, module: str, exc: LocalShapeError) -> str:
    """The warning for ``module`` kept whole after the local check failed on it: a weight
    module is replicated (its own forward fails on its shards, or, ``exc.collectives``, its
    code makes other collectives than its style was priced at); a block's code runs on whole
    activations."""
    why = str(exc).split(": ", 1)[1].splitlines()[0]
    if exc.collectives:
        return f"{module}: replicated: {why}"
    if any(op.kind == "module" and op.target == module for op in graph.ops):
        return f"{module}: replicated, since its own forward fails on its shards: {why}"
    return f"{module}: runs on whole activations, its weights still sharded: {why}"


def _replicate_module(graph: OpGraph, module: str) -> dict[int, str]:
    return {op.index: "replicate" for op in graph.ops if op.kind == "module" and op.target == module}


def _assemble(model, graph, solution, ctx, entries, blocks, *, opts, axes, tp_axis, strict: bool,
              whole: dict[str, str]) -> Plan:
    notes = shortfalls.plan_warnings(graph, solution, ctx.tp, budget=opts.memory_budget is not None,
                                     kept=set(whole)) + list(whole.values())
    plan = Plan(
        model=ModelInfo(class_name=type(model).__name__, fingerprint=fingerprint(model),
                        num_params=sum(p.numel() for p in model.parameters()), repeats=assemble.repeats(graph)),
        mesh=MeshInfo(axes=axes, tp_axis=tp_axis, ep_axis=expert_axis(axes, tp_axis)),
        options=opts,
        rules=assemble.rules(graph, solution, [], entries, blocks),
        regions=assemble.regions(graph, entries) + assemble.block_regions(graph, blocks),
        attributes=assemble.group_norm_attributes(graph, solution, ctx.tp),
        buffers=assemble.buffers(graph, solution),
        estimate=estimate(graph, solution, entries, ctx, blocks=blocks,
                          mesh=MeshInfo(axes=axes, tp_axis=tp_axis, ep_axis=expert_axis(axes, tp_axis))),
        warnings=notes,
    )
    plan.warnings.extend(_memory_warnings(plan, ctx))
    if strict and plan.warnings:
        raise PlanningError("strict planning refused the plan:\n  " + "\n  ".join(plan.warnings))
    return plan


_OVER_MEMORY = "predicted peak memory"


def _memory_warnings(plan: Plan, ctx: SolveContext) -> list[str]:
    device = ctx.hardware.memory_bytes
    if plan.options.memory_budget is not None or plan.estimate.peak_memory_bytes <= device:
        return []
    return [f"{_OVER_MEMORY} {cost.format_bytes(plan.estimate.peak_memory_bytes)} per device exceeds "
            f"{ctx.hardware.name}'s {cost.format_bytes(device)}: raise tp, add a data-parallel axis with "
            "data_parallel='fsdp' (e.g. --mesh dp=8,tp=8), or lower batch/sequence"]


def _with_experts(plan: Plan, graph: OpGraph, ctx: SolveContext, solution: Any) -> Plan:
    """Expert banks over the ep axis (:mod:`.decide.experts`), the memory warning redone for them."""
    plan = expert_parallel(plan, graph, ctx, solution)
    kept = [w for w in plan.warnings if not w.startswith(_OVER_MEMORY)]
    return plan.model_copy(update={"warnings": kept + _memory_warnings(plan, ctx)})


def _model_dtype(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(first.dtype if first is not None else None, "fp32")


def price_styles(
    model: nn.Module, mesh: Any, styles: Mapping[str, str | tuple[str, dict[str, str]]], *,
    example_inputs: tuple | None = None, **options: Any,
) -> Plan:
    """Plan ``model`` with the given modules pinned to the given styles (a hand-written plan,
    e.g. torchtitan's), so it is priced by the same cost model as the planner's own choice.
    ``styles`` maps module FQNs (fnmatch patterns allowed) to a style name or ``(name,
    {"input": "S1", "output": "R"})`` to pin layouts too. A style that does not exist, or a
    key that matches no module of ``model``, is a ``ValueError``: the user asked for a plan
    and must get that plan priced, not the planner's own."""
    _check_pins(model, styles)
    return plan_model(model, mesh, example_inputs=example_inputs, explain=False, _pinned=dict(styles), **options)


def _check_tp_size(model: nn.Module, tp: int) -> None:
    """Refuse at once a tp larger than any weight dimension: nothing could be split that many
    ways, and building a fake group that large to check the plan would take minutes."""
    sizes = [(max(p.shape), name) for name, p in model.named_parameters() if p.dim()]
    if not sizes:
        raise PlanningError(f"{type(model).__name__} has no parameters: there is nothing to shard")
    largest, name = max(sizes)
    if tp > largest:
        raise ValueError(f"tp={tp} is more ranks than any weight of {type(model).__name__} can be split into: its "
                         f"largest dimension is {largest} ({name}); use a tp of at most {largest}, usually a power "
                         "of two that divides the head count")


def _replicate_all(graph: OpGraph) -> dict[int, str]:
    """tp=1: nothing is split, so every weight module is simply replicated (the plan then
    costs nothing over not parallelizing at all)."""
    return {op.index: "replicate" for op in graph.ops if op.kind == "module"}


def _check_pins(model: nn.Module, styles: Mapping[str, Any]) -> None:
    from .plan.model import STYLES, matches

    modules = [name for name, _ in model.named_modules()]
    for key, value in styles.items():
        name = value[0] if isinstance(value, tuple) else value
        if isinstance(value, tuple):
            _check_layout_pin(key, value)
        if name not in STYLES:
            raise ValueError(f"price_styles: {key!r} is pinned to {name!r}, which is not a style; expected one of "
                             f"{', '.join(STYLES)}")
        if not any(matches(key, m) for m in modules):
            example = next((m for m in modules if m), "")
            raise ValueError(f"price_styles: {key!r} matches no module of {type(model).__name__} (module names look "
                             f"like {example!r}; use '*' for layer indices)")


_PIN_PLACEMENT = re.compile(r"^(R|P|S-?\d+)$")


def _check_layout_pin(key: str, value: tuple) -> None:
    if len(value) != 2 or not isinstance(value[1], Mapping):
        raise ValueError(f"price_styles: {key!r} is pinned to {value!r}; expected a style or (style, {{'input': 'S1'}})")
    for k, v in value[1].items():
        if k not in ("input", "output"):
            raise ValueError(f"price_styles: {key!r} pins layout {k!r}; the layouts are 'input' and 'output'")
        if not isinstance(v, str) or not _PIN_PLACEMENT.match(v):
            raise ValueError(f"price_styles: {key!r} pins {k} to {v!r}; placements are written R, P or S<d> (S1, S-1)")


def _pin(graph: OpGraph, styles: dict) -> dict[int, Any]:
    from .plan.model import matches

    forced = {}
    for op in graph.ops:
        if op.kind == "module":
            hit = next((v for k, v in styles.items() if matches(k, op.target)), None)
            if hit is not None:
                forced[op.index] = hit
    return forced


def _record_shapes(opts: PlanOptions, example_inputs: tuple) -> PlanOptions:
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return opts
    seq = first.shape[1] if first.dim() >= 2 and not first.is_floating_point() else opts.seq_len
    return opts.model_copy(update={"batch_size": int(first.shape[0]), "seq_len": None if seq is None else int(seq)})


def apply_plan(model: nn.Module, device_mesh: Any, plan: Plan, *, fsdp: Any = False) -> nn.Module:
    """Apply ``plan`` with ``parallelize_module`` (:mod:`shardplan.apply.emit`); with ``fsdp``
    (``True`` or a :class:`shardplan.apply.fsdp.FSDPOptions`), then ``fully_shard`` on the
    data axes (:func:`shardplan.apply.fsdp.fully_shard_plan`): TP first, as FSDP2 requires."""
    from .apply.emit import apply_plan as _apply

    if not isinstance(fsdp, bool):
        from .apply.fsdp import FSDPOptions

        if not isinstance(fsdp, FSDPOptions):
            raise ValueError(f"fsdp must be True, False or a shardplan.apply.fsdp.FSDPOptions; got {type(fsdp).__name__} "
                             f"{fsdp!r:.60}. E.g. fsdp=FSDPOptions(reshard_after_forward='always')")
    _apply(model, device_mesh, plan)
    if fsdp is not False:
        from .apply.fsdp import FSDPOptions, fully_shard_plan

        fully_shard_plan(model, device_mesh, plan, options=FSDPOptions() if fsdp is True else fsdp)
    return model


def auto_parallelize(model: nn.Module, device_mesh: Any, *, example_inputs: tuple | None = None, fsdp: Any = False,
                     **options: Any) -> nn.Module:
    """``plan_model`` then ``apply_plan``, on every rank. A rank whose planner fails makes
    every rank raise its message (one small exchange), instead of the others waiting for it
    until the process group times out. ``fsdp`` is :func:`apply_plan`'s."""
    from torch.distributed.device_mesh import DeviceMesh

    from .apply.agree import agree

    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"auto_parallelize needs a DeviceMesh to shard on; got {type(device_mesh).__name__}. "
                         "Make one on every rank, e.g. init_device_mesh('cuda', (8,), mesh_dim_names=('tp',)); "
                         "plan_model takes axis sizes like {'tp': 8} when you only want the plan")
    try:
        plan = plan_model(model, device_mesh, example_inputs=example_inputs, **options)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it; agree re-raises it
        agree(exc)
        raise
    for w in plan.warnings:
        warnings.warn(w, stacklevel=2)
    return apply_plan(model, device_mesh, plan, fsdp=fsdp)


