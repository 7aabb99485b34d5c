"""Report: a :class:`~shardplan.plan.Plan` rendered for people.

Contract
--------
``render_table(plan, *, model=None, console=None, show_why=False)`` prints one row per plan
rule (repeated layers stay folded as ``layers.*`` patterns): the module pattern, its style,
and, when ``model`` is given, the global weight shape of the first module the pattern
matches and the shape each device holds under the style; optionally the ``why``. After the
table come :func:`plan_summary_lines`: mesh and options, parameter bytes per device, peak
memory, communication per step, predicted step time (compute + comm), the collectives of a
forward and a backward, the regions and the warnings. ``decision_table`` renders
``Plan.explain`` output and ``diff_lines`` compares two plans. ``verify_table`` and
``verify_lines`` render a :class:`~shardplan.tools.verify.VerifyResult` (one row per compared
quantity: max difference, tolerance, where, pass/FAIL; then the largest gradient
differences and any problems). ``render_splits`` prints a
:class:`~shardplan.decide.splits.MeshComparison` (``shardplan plan --world-size``): one row
per dp x tp split with its samples per step, predicted step time, samples per second, peak
memory per device, whether it fits and which one was chosen, then the chosen split and why
any split has no plan. Nothing here computes a plan; everything reads what the plan
recorded (plus weight shapes from ``model``).

``console`` defaults to ``rich.console.Console()`` on stdout, which writes plain text when
stdout is not a terminal. Plan text (module patterns, messages) is never read as rich
markup, so ``[...]`` in a pattern prints as written.
"""

from __future__ import annotations

import re

import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..decide.cost import format_bytes, format_seconds
from ..decide.splits import MeshComparison, axes_str, data_ranks
from ..plan.model import Decision, Plan, matches
from ..plan.validate import sharded_dim, weight_of

__all__ = [
    "render_table", "plan_table", "plan_summary_lines", "decision_table", "diff_lines",
    "sharded_dim", "weight_of", "make_console", "verify_table", "verify_lines", "splits_table", "splits_lines",
    "render_splits",
]

_PIPE_WIDTH = 120  # rich's 80 columns fold most patterns when the output is piped


def make_console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr); wider than rich's 80 columns when not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=_PIPE_WIDTH)


def _shape_str(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "x".join(str(n) for n in shape) or "scalar"


def _shapes(plan: Plan, rule: Any, modules: list[tuple[str, Any]]) -> tuple[str, str]:
    mod = next((m for fqn, m in modules if matches(rule.module, fqn)), None)
    if rule.style == "ep_experts" and mod is not None and weight_of(mod) is None and hasattr(mod, "__len__"):
        # a list of expert modules, whole over ep
        return f"{len(mod)} experts", f"{len(mod) // plan.ep} experts"
    if rule.style == "listed_heads" and mod is not None:
        from ..analyze.trace import listed_heads  # torch is loaded: a model was given

        n = len(mod.get_submodule(listed_heads(mod)[0]))  # a list of head modules, whole over tp
        return f"{n} heads", f"{n // plan.tp} heads"
    if rule.style == "dtensor_weights" and mod is not None:
        return _dtensor_weights_shapes(plan, rule, mod)
    weight = None if mod is None else weight_of(mod)
    if weight is None:
        return "-", "-"
    shape = tuple(int(n) for n in weight.shape)
    dim = sharded_dim(rule.style, mod)
    if dim is None or dim >= len(shape):
        return _shape_str(shape), _shape_str(shape)
    parts = rule.groups if rule.style == "colwise_kv_replicated" and rule.groups else plan.ep if (
        rule.style == "ep_experts") else plan.tp
    local = list(shape)
    local[dim] = -(-shape[dim] // parts)  # torch's chunking: rank 0 holds the ceiling
    inner = sharded_dim("moe_tp_experts", mod) if rule.style == "ep_experts" and rule.inner == "moe_tp_experts" else None
    if inner is not None and inner < len(shape):  # each rank's experts split inside over tp too
        local[inner] = -(-shape[inner] // plan.tp)
    mark = "" if shape[dim] % parts == 0 else " (uneven)"
    return _shape_str(shape), _shape_str(tuple(local)) + mark


def _dtensor_weights_shapes(plan: Plan, rule: Any, mod: Any) -> tuple[str, str]:
    """Its 2-D+ weights, each whole and as a rank holds it (``param_layouts``)."""
    whole, local = [], []
    for name, p in mod.named_parameters():
        if p.dim() < 2:
            continue
        shape = [int(n) for n in p.shape]
        mine = list(shape)
        m = re.fullmatch(r"Shard\((-?\d+)\)", rule.param_layouts.get(name, "Replicate"))
        if m:
            mine[int(m.group(1))] = -(-shape[int(m.group(1))] // plan.tp)
        whole.append(f"{name} {_shape_str(tuple(shape))}")
        local.append(_shape_str(tuple(mine)))
    return ", ".join(whole) or "-", ", ".join(local) or "-"


def plan_table(plan: Plan, *, model: Any = None, show_why: bool = False) -> Table:
    """The rules as a rich Table; shape columns only when ``model`` is given."""
    table = Table(title=f"{plan.model.class_name} on {_mesh_str(plan)}", title_justify="left")
    table.add_column("module", overflow="fold")
    table.add_column("style")
    if model is not None:
        table.add_column("weight", justify="right")
        table.add_column(f"per device (tp={plan.tp}{f', ep={plan.ep}' if plan.ep > 1 else ''})", justify="right")
    if show_why:
        table.add_column("why", overflow="fold")
    modules = list(model.named_modules()) if model is not None else []
    for rule in plan.rules:
        row = [Text(rule.module), Text(rule.style)]
        if model is not None:
            row += [Text(s) for s in _shapes(plan, rule, modules)]
        if show_why:
            row.append(Text(rule.why))
        table.add_row(*row)
    return table


def render_table(plan: Plan, *, model: Any = None, console: Console | None = None, show_why: bool = False) -> None:
    """Print the rules table and the summary lines."""
    console = console or make_console()
    console.print(plan_table(plan, model=model, show_why=show_why))
    for line in plan_summary_lines(plan):
        console.print(Text(line), soft_wrap=True)


# --------------------------------------------------------------------------- summary


def _mesh_str(plan: Plan) -> str:
    return ",".join(f"{k}={v}" for k, v in plan.mesh.axes.items())


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _options_str(plan: Plan) -> str:
    o = plan.options
    sp = {None: "auto", True: "on", False: "off"}[o.sequence_parallel]
    budget = "none" if o.memory_budget is None else format_bytes(o.memory_budget)
    return (
        f"batch {o.batch_size if o.batch_size is not None else '-'}, seq {o.seq_len if o.seq_len is not None else '-'}, "
        f"{o.dtype or 'model dtype'}, {o.hardware}, memory budget {budget}, sequence parallel {sp}, "
        f"loss parallel {'on' if o.loss_parallel else 'off'}, optimizer {o.optimizer}"
    )


def collectives_str(counts: dict[str, int]) -> str:
    parts = [f"{n} {kind}" for kind, n in counts.items() if n]
    return ", ".join(parts) or "none"


def _estimate_lines(plan: Plan) -> list[str]:
    e = plan.estimate
    if e is None:
        return ["estimate: none recorded in this plan"]
    lines = [
        f"parameters per device: {format_bytes(e.param_bytes_per_device)}",
        f"peak memory per device: {format_bytes(e.peak_memory_bytes)} (parameters, gradients, optimizer state, activations)",
        f"communication per step: {format_bytes(e.comm_bytes_per_step)} sent per device",
        f"predicted step time: {format_seconds(e.step_time_s)} "
        f"(compute {format_seconds(e.compute_time_s)} + comm {format_seconds(e.comm_time_s)})",
    ]
    for phase, c in e.collectives.items():
        lines.append(f"collectives per {phase}: {collectives_str(c.model_dump())}")
    return lines


def plan_summary_lines(plan: Plan) -> list[str]:
    """Mesh, options, estimates, regions, buffers and warnings, one fact per line."""
    lines = [
        f"model: {plan.model.class_name}, {_count(plan.model.num_params)} parameters ({plan.model.fingerprint})",
        f"mesh: {_mesh_str(plan)} (tensor parallel on '{plan.mesh.tp_axis}', tp={plan.tp})",
        f"options: {_options_str(plan)}",
        *_estimate_lines(plan),
    ]
    if plan.regions:
        lines.append(f"regions ({len(plan.regions)}): one collective where several Linears share an input")
        lines += [f"  {r.module} (input {r.input}): {r.why}" for r in plan.regions]
    if plan.buffers:
        lines.append(f"buffers ({len(plan.buffers)}): tensors forward writes into, each rank holding its shard")
        lines += [f"  {b.module}: " + ", ".join(f"{n} {layout}" + (f" in {b.groups[n]} groups" if n in b.groups else "")
                                                for n, layout in b.layouts.items()) for b in plan.buffers]
    if plan.warnings:
        lines.append(f"warnings ({len(plan.warnings)}):")
        lines += [f"  {w}" for w in plan.warnings]
    return lines


# --------------------------------------------------------------------------- world size


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def splits_table(comparison: MeshComparison) -> Table:
    """One row per dp x tp split; the estimates are the plans' own (rounded, portable)."""
    named = next((c.plan.model.class_name for c in comparison.candidates if c.plan is not None), "model")
    kinds = "dp x ep x tp" if any("ep" in c.axes for c in comparison.candidates) else "dp x tp"
    table = Table(title=Text(f"{named}: {kinds} splits of {comparison.world_size} devices"), title_justify="left")
    for name in ("split", "samples/step", "step time", "samples/s", "peak memory/device", "fits", "note"):
        table.add_column(name, justify="left" if name in ("split", "fits", "note") else "right")
    for i, c in enumerate(comparison.candidates):
        if c.plan is None or c.plan.estimate is None:
            table.add_row(axes_str(c.axes), "-", "-", "-", "-", "-", "no plan (below)")
            continue
        e, warned = c.plan.estimate, len(c.plan.warnings)
        note = "chosen" if i == comparison.chosen else f"{warned} warning{'s' * (warned != 1)}" if warned else ""
        table.add_row(axes_str(c.axes), str(data_ranks(c.axes) * (c.plan.options.batch_size or 1)),
                      format_seconds(e.step_time_s), _rate(c.samples_per_s or 0.0), format_bytes(e.peak_memory_bytes),
                      "yes" if c.fits else "no", note)
    return table


def splits_lines(comparison: MeshComparison) -> list[str]:
    """The memory limit, the choice, and why a split has no plan."""
    lines = [f"memory limit: {format_bytes(comparison.memory_limit)} per device ({comparison.limit_source})"]
    if comparison.chosen is not None:
        ranks = "dp x ep" if any("ep" in c.axes for c in comparison.candidates) else "dp"
        lines.append(f"chosen: {axes_str(comparison.candidates[comparison.chosen].axes)}, the most samples per second "
                     f"of the splits that fit (samples/step = {ranks} x batch per replica)")
    lines += [f"{axes_str(c.axes)}: no plan: {c.error.splitlines()[0] if c.error else 'no estimate'}"
              for c in comparison.candidates if c.plan is None]
    return lines


def render_splits(comparison: MeshComparison, *, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(splits_table(comparison))
    for line in splits_lines(comparison):
        console.print(Text(line), soft_wrap=True)


# --------------------------------------------------------------------------- explain


def _delta_seconds(delta: float) -> str:
    return ("+" if delta > 0 else "") + format_seconds(delta) if delta else "same"


def _delta_bytes(delta: float) -> str:
    return ("+" if delta > 0 else "") + format_bytes(delta) if delta else "same"


def decision_table(decision: Decision, *, fqn: str) -> Table:
    """The chosen style and every alternative: step time, its delta, parameter bytes."""
    title = f"{fqn}: {decision.style}" + ("" if fqn == decision.module else f" (rule {decision.module})")
    table = Table(title=title, title_justify="left")
    for name in ("style", "step time", "vs chosen", "params/device", "note"):
        table.add_column(name, overflow="fold")
    table.add_row(Text(decision.style), format_seconds(decision.step_time_s), "-",
                  format_bytes(decision.param_bytes_per_device), "chosen")
    for alt in decision.alternatives:
        if alt.step_time_s is None:
            table.add_row(Text(alt.style), "-", "-", "-", Text(alt.reason or "infeasible"))
            continue
        params = alt.param_bytes_per_device or 0.0
        note = f"params {_delta_bytes(params - decision.param_bytes_per_device)}"
        table.add_row(Text(alt.style), format_seconds(alt.step_time_s),
                      _delta_seconds(alt.step_time_s - decision.step_time_s), format_bytes(params), Text(note))
    return table


# --------------------------------------------------------------------------- diff


def _pct(a: float, b: float) -> str:
    if a == b:
        return "(same)"
    if a == 0:
        return "(new)"
    return f"({(b - a) / abs(a) * 100:+.1f}%)"


def _rule_changes(a: Plan, b: Plan) -> list[str]:
    ra, rb = {r.module: r for r in a.rules}, {r.module: r for r in b.rules}
    out = [f"  + {m}: {rb[m].style}" for m in rb if m not in ra]
    out += [f"  - {m}: {ra[m].style}" for m in ra if m not in rb]
    for m in (m for m in ra if m in rb):
        x, y = ra[m], rb[m]
        old = (x.style, x.input_layouts, x.output_layouts)
        new = (y.style, y.input_layouts, y.output_layouts)
        if old != new:
            out.append(f"  ~ {m}: {_rule_str(*old)} -> {_rule_str(*new)}")
    return out


def _rule_str(style: str, inp: str | None, out: str | None) -> str:
    extra = ([f"in {inp}"] if inp else []) + ([f"out {out}"] if out else [])
    return style + (f" ({', '.join(extra)})" if extra else "")


def _region_changes(a: Plan, b: Plan) -> list[str]:
    key = lambda r: (r.module, str(r.input))  # noqa: E731
    ra, rb = {key(r): r for r in a.regions}, {key(r): r for r in b.regions}
    out = [f"  + {k[0]} (input {k[1]}): {rb[k].input_layouts}" for k in rb if k not in ra]
    out += [f"  - {k[0]} (input {k[1]}): {ra[k].input_layouts}" for k in ra if k not in rb]
    out += [
        f"  ~ {k[0]} (input {k[1]}): {ra[k].input_layouts} -> {rb[k].input_layouts}"
        for k in ra if k in rb and ra[k].model_dump(exclude={"why"}) != rb[k].model_dump(exclude={"why"})
    ]
    return out


def _header_changes(a: Plan, b: Plan) -> list[str]:
    out = []
    if a.model.fingerprint != b.model.fingerprint:
        out.append(f"model: {a.model.class_name} {a.model.fingerprint} -> {b.model.class_name} {b.model.fingerprint}")
    if a.mesh != b.mesh:
        out.append(f"mesh: {_mesh_str(a)} -> {_mesh_str(b)}")
    oa, ob = a.options.model_dump(), b.options.model_dump()
    out += [f"option {k}: {oa[k]} -> {ob[k]}" for k in oa if oa[k] != ob.get(k)]
    return out


def _estimate_changes(a: Plan, b: Plan) -> list[str]:
    if a.estimate is None or b.estimate is None:
        return ["  (one of the plans records no estimate)"] if a.estimate is not b.estimate else []
    ea, eb = a.estimate, b.estimate
    rows = [
        ("param bytes/device", ea.param_bytes_per_device, eb.param_bytes_per_device, format_bytes),
        ("peak memory/device", ea.peak_memory_bytes, eb.peak_memory_bytes, format_bytes),
        ("comm bytes/step", ea.comm_bytes_per_step, eb.comm_bytes_per_step, format_bytes),
        ("step time", ea.step_time_s, eb.step_time_s, format_seconds),
        ("compute time", ea.compute_time_s, eb.compute_time_s, format_seconds),
        ("comm time", ea.comm_time_s, eb.comm_time_s, format_seconds),
    ]
    out = [f"  {name}: {fmt(x)} -> {fmt(y)} {_pct(x, y)}" for name, x, y, fmt in rows]
    phases = [p for p in ("forward", "backward") if p in ea.collectives or p in eb.collectives]
    for phase in phases + sorted((set(ea.collectives) | set(eb.collectives)) - set(phases)):
        ca = ea.collectives[phase].model_dump() if phase in ea.collectives else {}
        cb = eb.collectives[phase].model_dump() if phase in eb.collectives else {}
        for kind in sorted(set(ca) | set(cb)):
            x, y = ca.get(kind, 0), cb.get(kind, 0)
            if x or y:
                out.append(f"  {phase} {kind}: {x} -> {y} {_pct(x, y)}")
    return out


def diff_lines(a: Plan, b: Plan) -> list[str]:
    """What changed from plan ``a`` to plan ``b``: header, rules, regions, estimates."""
    lines = _header_changes(a, b)
    rules, regions = _rule_changes(a, b), _region_changes(a, b)
    lines += (["rules:"] + rules) if rules else ["rules: no changes"]
    lines += (["regions:"] + regions) if regions else ["regions: no changes"]
    return lines + ["estimate:"] + _estimate_changes(a, b)


# --------------------------------------------------------------------------- verify


def verify_table(result: Any) -> Table:
    """One row per compared quantity of a :class:`~shardplan.tools.verify.VerifyResult`."""
    plan = result.plan
    mesh = f"tp={plan.tp}" if plan.mesh.axes == {plan.mesh.tp_axis: plan.tp} else (
        _mesh_str(plan) if plan.ep > 1 else f"tp={plan.tp} of {_mesh_str(plan)}")
    title = f"verify {result.model}: {mesh} on {result.nproc} gloo ranks vs unsharded (float32)"
    table = Table(title=Text(title), title_justify="left")
    for name, justify in (("quantity", "left"), ("max |tp - ref|", "right"), ("tolerance", "right"),
                          ("worst at", "left"), ("result", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for row in result.rows:
        many = row.quantity in ("weights", "grad")
        what = f"{row.quantity} ({row.count})" if many else row.quantity
        table.add_row(Text(what), f"{row.max_abs:.2e}", row.tolerance, Text(row.where if many and row.where else "-"),
                      Text("pass" if row.passed else "FAIL", style="green" if row.passed else "bold red"))
    return table


def verify_lines(result: Any) -> list[str]:
    """What the table leaves out: the largest gradient differences, problems, the verdict."""
    lines = []
    if result.top_grads:
        lines.append("largest gradient differences: " + ", ".join(f"{n} {d:.2e}" for n, d in result.top_grads))
    if result.worst_param:
        row = result.row("grad")
        lines.append(f"worst parameter: {result.worst_param} (|diff| {result.worst_param_diff:.2e}; "
                     f"tolerance {row.tolerance})")
    shapes = ", ".join(_shape_str(s) for s in result.inputs)
    lines.append(f"{result.sharded_params} of {result.num_params} parameters sharded; inputs {shapes or '-'}; "
                 f"{result.seconds:.1f} s on the ranks")
    if result.problems:
        lines.append(f"problems ({len(result.problems)}):")
        lines += [f"  {p}" for p in result.problems]
    lines.append(result.summary())
    return lines
