"""Public API: ``plan_model`` (decide), ``apply_plan`` (apply), ``auto_parallelize`` (both).

Contract
--------
``plan_model(model, mesh, *, example_inputs=None, **options) -> Plan`` traces the model on
meta tensors, builds the op graph, solves the placement program and returns the plan as
data. It never needs a process group: ``mesh`` may be a ``DeviceMesh`` or axis sizes
(``{"tp": 8}``, ``{"dp": 16, "tp": 8}``); tensor parallelism runs on the axis named
``tp`` (else the last axis). Same model, mesh and options -> byte-identical plan.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import cost
from .estimate import estimate
from .explain import explain_decisions
from .graph import OpGraph, build_graph
from .localcheck import check_local_shapes
from .plan import MeshInfo, ModelInfo, Plan, PlanOptions, Region, Rule, fingerprint
from .regions import Entry, PartialBlock, find_partial_blocks, find_regions
from .solve import PlanningError, Solution, SolveContext, solve
from .strategies import placement_str
from .trace import TraceError, trace_model

__all__ = ["plan_model", "apply_plan", "auto_parallelize", "price_styles", "mesh_axes", "PlanningError", "TraceError"]

_EXTRA_OPTIONS = ("explain", "tp_axis", "fold_repeated", "strict", "check", "_pinned")
_OPTION_NAMES = set(PlanOptions.model_fields) | set(_EXTRA_OPTIONS)


def mesh_axes(mesh: Any) -> dict[str, int]:
    """Axis sizes from a DeviceMesh or a mapping, validated."""
    if isinstance(mesh, Mapping):
        axes = {str(k): v for k, v in mesh.items()}
    elif hasattr(mesh, "mesh_dim_names"):
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        axes = dict(zip(names, mesh.mesh.shape))
    else:
        raise ValueError(f"mesh must be a DeviceMesh or axis sizes like {{'tp': 8}}; got {type(mesh).__name__}")
    bad = {k: v for k, v in axes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if not axes or bad:
        raise ValueError(f"mesh axis sizes must be positive integers, e.g. {{'tp': 8}}; got {axes}")
    return {k: int(v) for k, v in axes.items()}


def _tp_axis(axes: dict[str, int], requested: str | None) -> str:
    if requested is not None:
        if requested not in axes:
            raise ValueError(f"tp_axis {requested!r} is not a mesh axis; the mesh has {list(axes)}")
        return requested
    return "tp" if "tp" in axes else list(axes)[-1]


def infer_example_inputs(model: nn.Module, *, batch_size: int, seq_len: int) -> tuple:
    """Token ids for models that start with an Embedding, features for ones that start with a Linear."""
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    if isinstance(first, nn.Embedding):
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta"),)
    if isinstance(first, nn.Linear):
        return (torch.zeros(batch_size, first.in_features, device="meta"),)
    raise ValueError(
        f"cannot infer example inputs for {type(model).__name__}: its first weight module is "
        f"{type(first).__name__ if first else 'missing'}; pass example_inputs=(tensor, ...) shaped like a real batch"
    )


def _options(opts: dict[str, Any]) -> tuple[PlanOptions, dict[str, Any]]:
    unknown = sorted(set(opts) - _OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown plan_model option(s) {unknown}; expected some of {sorted(_OPTION_NAMES)}")
    extra = {k: opts.pop(k) for k in _EXTRA_OPTIONS if k in opts}
    if isinstance(opts.get("memory_budget"), str):
        opts["memory_budget"] = cost.parse_bytes(opts["memory_budget"])
    if "dtype" in opts:
        cost.dtype_bytes(opts["dtype"])
    return PlanOptions(**opts), extra


def _state_shards(axes: dict[str, int], tp_axis: str, data_parallel: str) -> int:
    if data_parallel == "ddp":
        return 1
    n = 1
    for name, size in axes.items():
        n *= size if name != tp_axis else 1
    return n


def _trace(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, fold: bool):
    """Hugging Face models build a KV cache unless told not to; planning traces training."""
    config = getattr(model, "config", None)
    saved = getattr(config, "use_cache", None)
    if saved:
        config.use_cache = False
    try:
        return trace_model(model, example_inputs, example_kwargs=example_kwargs, fold_repeated=fold)
    finally:
        if saved:
            config.use_cache = saved


def plan_model(
    model: nn.Module, mesh: Any, *, example_inputs: tuple | None = None, example_kwargs: dict | None = None, **options: Any
) -> Plan:
    """Decide the tensor-parallel plan of ``model`` on ``mesh``; see the module docstring."""
    opts, extra = _options(dict(options))
    if opts.dtype is None:
        opts = opts.model_copy(update={"dtype": _model_dtype(model)})
    axes = mesh_axes(mesh)
    tp_axis = _tp_axis(axes, extra.get("tp_axis"))
    hardware = cost.get_hardware(opts.hardware)
    if example_inputs is None:
        example_inputs = infer_example_inputs(model, batch_size=opts.batch_size or 1, seq_len=opts.seq_len or 2048)
    elif not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    graph = build_graph(_trace(model, example_inputs, example_kwargs, extra.get("fold_repeated", True)))
    if not any(op.kind == "module" for op in graph.ops):
        raise PlanningError(f"{type(model).__name__} has no weight modules called in forward: nothing to shard")
    ctx = SolveContext(
        tp=axes[tp_axis], hardware=hardware, link=cost.axis_links(hardware, axes)[tp_axis],
        dtype=opts.dtype, memory_budget=opts.memory_budget, opts=opts,
        state_shards=_state_shards(axes, tp_axis, opts.data_parallel),
        forced=_pin(graph, extra.get("_pinned") or {}),
    )
    solution = solve(graph, ctx)
    entries = find_regions(graph, solution)
    blocks = find_partial_blocks(graph, solution)
    opts = _record_shapes(opts, example_inputs)
    notes = _warnings(graph, solution, ctx.tp)
    if extra.get("strict") and notes:
        raise PlanningError("strict planning refused the plan:\n  " + "\n  ".join(notes))
    decisions = explain_decisions(graph, solution, ctx) if extra.get("explain", True) else []
    plan = Plan(
        model=ModelInfo(class_name=type(model).__name__, fingerprint=fingerprint(model),
                        num_params=sum(p.numel() for p in model.parameters()), repeats=_repeats(graph)),
        mesh=MeshInfo(axes=axes, tp_axis=tp_axis),
        options=opts,
        rules=_rules(graph, solution, decisions, entries, blocks),
        regions=_regions(graph, entries) + _block_regions(graph, blocks),
        estimate=estimate(graph, solution, entries, ctx, blocks=blocks),
        decisions=decisions,
        warnings=notes,
    )
    device = hardware.memory_bytes
    if opts.memory_budget is None and plan.estimate.peak_memory_bytes > device:
        plan.warnings.append(
            f"predicted peak memory {cost.format_bytes(plan.estimate.peak_memory_bytes)} per device exceeds "
            f"{hardware.name}'s {cost.format_bytes(device)}: raise tp, add a data-parallel axis with "
            "data_parallel='fsdp' (e.g. --mesh dp=8,tp=8), or lower batch/sequence"
        )
    if extra.get("check", True):
        check_local_shapes(graph, plan, solution.placements)
    return plan


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
    {"input": "S1", "output": "R"})`` to pin layouts too."""
    return plan_model(model, mesh, example_inputs=example_inputs, explain=False, _pinned=dict(styles), **options)


def _pin(graph: OpGraph, styles: dict) -> dict[int, Any]:
    from .plan import matches

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


def _pattern_map(graph: OpGraph) -> dict[str, str]:
    """Representative block prefix -> ``container.*`` when it stands for every sibling."""
    reps: dict[str, list[str]] = {}
    for inst, rep in graph.traced.folded.items():
        reps.setdefault(rep, []).append(inst)
    out = {}
    for rep, insts in reps.items():
        container, _, _ = rep.rpartition(".")
        siblings = {n for n, _ in graph.model.get_submodule(container).named_children()} if container else set()
        covered = {rep.rpartition(".")[2]} | {i.rpartition(".")[2] for i in insts}
        out[rep] = f"{container}.*" if siblings == covered else ""
    return out


def _patterned(fqn: str, graph: OpGraph, pmap: dict[str, str]) -> list[str]:
    for rep, pattern in pmap.items():
        if fqn == rep or fqn.startswith(rep + "."):
            if pattern:
                return [pattern + fqn[len(rep):]]
            insts = [i for i, r in graph.traced.folded.items() if r == rep]
            return [fqn] + [i + fqn[len(rep):] for i in insts]
    return [fqn]


def _rules(
    graph: OpGraph, solution: Solution, decisions: list, entries: list[Entry], blocks: list[PartialBlock]
) -> list[Rule]:
    pmap = _pattern_map(graph)
    why = {d.module: d for d in decisions}
    # inside a region the input is already a Replicate DTensor: a Linear that re-declared
    # Shard(seq) would redistribute Replicate -> Replicate, whose backward all-reduces its
    # own Partial gradient and defeats the region
    in_region = {c for e in entries for _, inside in e.sites for c in inside}
    partial = {r for b in blocks for r in b.rowwise}
    returned = {v for op in graph.ops if op.kind == "output" for v in op.inputs}
    rules: list[Rule] = []
    for op in graph.ops:
        if op.kind != "module":
            continue
        s = solution.strategies[op.index]
        inp = None if op.index in in_region else _layout(s.layouts.get("input"))
        for module in _patterned(op.target, graph, pmap):
            rules.append(Rule(
                module=module, style=s.name,
                input_layouts=inp, output_layouts=_rule_output(op, s, partial, returned),
                copy_output=s.name != "replicate" and _modified_in_place(graph, op),
                packed=s.layouts.get("packed"),
                why=_why(why.get(_patterned(op.target, graph, pmap)[0])),
            ))
    rules += [Rule(module=fqn, style="replicate", why="not called in forward: kept whole") for fqn in _unused_modules(graph)]
    rules += [
        Rule(module=fqn, style="replicate", why="container that owns parameters directly: they stay plain, whole tensors")
        for fqn in _containers(graph)
    ]
    return rules


def _containers(graph: OpGraph) -> list[str]:
    from .trace import is_weight_leaf, owns_params

    called = set(graph.module_multiplicity)
    return [
        fqn for fqn, mod in graph.model.named_modules()
        if owns_params(mod) and not is_weight_leaf(mod) and any(c.startswith(fqn + ".") for c in called)
    ]


_IN_PLACE = {"iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "masked_fill_", "clamp_"}


def _modified_in_place(graph: OpGraph, op) -> bool:
    """Is the module's output the target of an in-place op (Falcon's ``mlp_output += attn``)?
    fx records ``a += b`` on a proxy as ``add``, so the source line tells augmented assignment."""
    for c in graph.consumers.get(op.output, []):
        user = graph.ops[c]
        if user.inputs[:1] != [op.output]:
            continue
        if user.target in _IN_PLACE or (user.target in ("add", "sub", "mul", "truediv") and _AUGMENTED.search(_code(user.node))):
            return True
    return False


_AUGMENTED = re.compile(r"^\s*[\w.\[\]]+\s*[-+*/]=[^=]")


def _code(node) -> str:
    from .trace import _user_line

    line = _user_line(node)
    return line.split("`")[1] if line.count("`") >= 2 else ""


def _rule_output(op, s, partial: set[int], returned: set[int]) -> str | None:
    if op.index in partial:
        return "Partial"
    if s.name == "colwise" and op.output in returned:
        return "Shard(-1)"  # vocab-sharded logits handed to the user for loss_parallel()
    return _layout(s.layouts.get("output"))


def _layout(p: str | None) -> str | None:
    return None if p is None else placement_str(p).replace("()", "")


def _why(decision) -> str:
    if decision is None:
        return ""
    parts = []
    for alt in decision.alternatives:
        if alt.step_time_s is None:
            parts.append(f"{alt.style}: {alt.reason or 'infeasible'}")
        else:
            delta = alt.step_time_s - decision.step_time_s
            mem = (alt.param_bytes_per_device or 0) - decision.param_bytes_per_device
            parts.append(f"{alt.style}: {cost.format_seconds(delta)} slower" if delta > 0 and mem <= 0
                         else f"{alt.style}: +{cost.format_bytes(mem)}/device" if mem > 0 else f"{alt.style}: tie")
    return "; ".join(parts)


def _unused_modules(graph: OpGraph) -> list[str]:
    called = set(graph.module_multiplicity) | set(graph.traced.folded)
    above = {c.rsplit(".", k)[0] for c in called for k in range(1, c.count(".") + 1)} | ({""} if called else set())
    out = []
    for fqn, mod in graph.model.named_modules():
        parts = fqn.split(".")
        inside_called = any(".".join(parts[:k]) in called for k in range(1, len(parts) + 1))
        if any(True for _ in mod.parameters(recurse=False)) and not inside_called and fqn not in above:
            out.append(fqn)
    return out


def _regions(graph: OpGraph, entries: list[Entry]) -> list[Region]:
    pmap = _pattern_map(graph)
    regions = []
    for e in entries:
        for site, inside in e.sites:
            names = ", ".join(graph.ops[c].target.rpartition(".")[2] for c in inside)
            comm = "all-reduce" if e.kind == "R" else "all-gather/reduce-scatter"
            for module in _patterned(site.module, graph, pmap):
                regions.append(Region(
                    module=module, input="output" if site.input is None else site.input,
                    num_inputs=site.num_inputs, input_layouts=_layout(e.kind),
                    desired_input_layouts="Replicate",
                    why=f"{names} share this input: one {comm} instead of {len(inside)}",
                ))
    return regions


def _block_regions(graph: OpGraph, blocks: list[PartialBlock]) -> list[Region]:
    pmap = _pattern_map(graph)
    out = []
    for b in blocks:
        names = ", ".join(graph.ops[r].target.rpartition(".")[2] for r in b.rowwise)
        for module in _patterned(b.module, graph, pmap):
            out.append(Region(module=module, input=b.input, num_inputs=b.num_inputs,
                              why=f"residual enters as a Replicate DTensor so {names} can stay Partial"))
            out.append(Region(module=module, input="output", num_inputs=b.num_inputs, input_layouts="Partial",
                              use_local_output=True,
                              why=f"one all-reduce sums {names} and the residual instead of {len(b.rowwise)}"))
    return out


def _warnings(graph: OpGraph, solution: Solution, tp: int) -> list[str]:
    """Where the plan falls short of splitting a weight and its compute tp ways."""
    out = list(graph.traced.notes)
    output_values = {v for op in graph.ops if op.kind == "output" for v in op.inputs}
    pmap = _pattern_map(graph)
    for op in graph.ops:
        if op.kind != "module":
            continue
        style = solution.strategies[op.index].name
        module = graph.model.get_submodule(op.target)
        name = _patterned(op.target, graph, pmap)[0]
        if op.module_kind == "other":
            out.append(f"{name}: {type(module).__name__} has no tensor-parallel style; replicated")
        elif op.module_kind in ("linear", "conv1d", "embedding", "experts") and style == "replicate":
            shapes = [list(p.shape) for p in module.parameters(recurse=False) if p.dim() >= 2]
            out.append(f"{name}: weight {shapes[0] if len(shapes) == 1 else shapes} not sharded: no dimension of it divides by tp={tp}")
        elif style == "colwise_gather_output" and op.output not in output_values:
            out.append(
                f"{name}: output all-gathered: the ops after it cannot run on a 1/{tp} shard "
                f"(a head count or reshape that does not divide by tp={tp}?); use a tp that divides the head counts"
            )
    for fqn in _unused_modules(graph):
        out.append(f"{fqn}: owns parameters but is not called in forward; replicated")
    return out


def apply_plan(model: nn.Module, device_mesh: Any, plan: Plan) -> nn.Module:
    """Apply ``plan`` with ``parallelize_module``; see :mod:`shardplan.emit`."""
    from .emit import apply_plan as _apply

    return _apply(model, device_mesh, plan)


def auto_parallelize(model: nn.Module, device_mesh: Any, *, example_inputs: tuple | None = None, **options: Any) -> nn.Module:
    plan = plan_model(model, device_mesh, example_inputs=example_inputs, **options)
    for w in plan.warnings:
        warnings.warn(w, stacklevel=2)
    return apply_plan(model, device_mesh, plan)


def _repeats(graph: OpGraph) -> dict[str, int | list[str]]:
    out: dict[str, int | list[str]] = {}
    for fqn, mod in graph.model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and fqn:
            names = [n for n, _ in mod.named_children()]
            out[fqn] = len(names) if names == [str(i) for i in range(len(names))] else names
    return out
