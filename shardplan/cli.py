"""Command line: ``shardplan plan|explain|check|diff|simulate|verify|schema``.

Contract
--------
``main(argv=None) -> int`` parses ``argv`` (default ``sys.argv[1:]``), runs one subcommand
and returns its exit status; it never calls ``sys.exit`` itself. ``python -m shardplan``
and the ``shardplan`` console script call :func:`entry`, which ends the process as soon as
the command's output is flushed and the ``atexit`` handlers have run: tearing down the
interpreter (torch, transformers, a 61-layer model on meta) takes 0.6-0.9 s and does
nothing a finished command needs. Data (tables, YAML, JSON, findings) goes to
stdout; progress and confirmations go to stderr, and the progress spinner shows only when
stderr is a terminal.

Exit status: 0 success; 1 when ``check`` finds problems, ``simulate`` counts collectives (or
their logical bytes) other than the plan predicts, or ``verify`` finds the sharded model
differing from the unsharded one; 2 for unusable input, including a ``verify`` whose ranks
crashed or timed out (one line saying which rank and why). A user error (``ValueError`` and
its subclasses ``PlanningError``, ``TraceError``, ``PlanFileError``; ``OSError`` such as
``FileExistsError``, ``FileNotFoundError``, ``PermissionError``) prints ``shardplan: error:
<message>`` on stderr (one line, plus one more for the details of a multi-line message),
never a traceback. Any other exception prints ``shardplan: error: internal error: <type>:
<message>`` and a hint line (exit 2), or raises with its traceback when the environment
sets ``SHARDPLAN_TRACEBACK=1``. argparse's own usage errors also exit 2. Every command's
``--help`` ends with examples.

``--mesh`` is ``axis=size`` pairs separated by commas (``tp=8``, ``dp=16,tp=8``, ``ep=8,tp=8``); tensor
parallelism runs on ``tp`` (else the last axis that is not a data axis). ``plan
--world-size N`` (exclusive with ``--mesh``) prints every dp x tp split of N devices in one
table (:func:`shardplan.api.compare_meshes`; on stderr when stdout carries YAML/JSON), then
outputs the chosen split's plan as ``--mesh`` would, or fails when none fits. Only the
planning options given on the command line reach :func:`shardplan.plan_model`, so its
defaults stay the defaults.
``verify`` plans for ``--mesh tp=NPROC`` unless ``--mesh`` or ``--plan`` says otherwise, and
the plan's tp must equal ``--nproc`` (see :mod:`shardplan.tools.verify`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "parse_mesh"]

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
_MAX_COUNT = 2**31 - 1
_AXIS_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([1-9][0-9]*)")
_MESH_EXAMPLE = "e.g. --mesh tp=8 or --mesh dp=16,tp=8"
_TRACEBACK_ENV = "SHARDPLAN_TRACEBACK"  # set: unexpected errors show their traceback
_CPU_FALLBACK_PARAMS = 100_000_000  # simulate re-runs models up to this size on CPU if meta fails


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=16,tp=8"`` -> ``{"dp": 16, "tp": 8}``; anything else raises ``ValueError``."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = _AXIS_RE.fullmatch(part.strip())
        if m is None:
            raise ValueError(
                f"bad --mesh {text!r}: expected axis=size pairs (positive sizes) separated by commas, {_MESH_EXAMPLE}"
            )
        if m.group(1) in axes:
            raise ValueError(f"bad --mesh {text!r}: axis {m.group(1)!r} appears twice; {_MESH_EXAMPLE}")
        axes[m.group(1)] = int(m.group(2))
    return axes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > _MAX_COUNT:  # a batch or sequence no tensor can hold (torch sizes are int64)
        raise argparse.ArgumentTypeError(f"{text} is too large; expected at most {_MAX_COUNT}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# --------------------------------------------------------------------------- parser


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def _add_model_options(p: argparse.ArgumentParser, *, mesh_default: str | None = "tp=8", world_size: bool = False) -> None:
    from .decide.hardware import HARDWARE
    from .models import PRESET_NAMES

    p.add_argument("model", metavar="MODEL", help=(
        f"a preset ({', '.join(PRESET_NAMES)}), 'package.module:callable', 'hf:<model_type>' or a path to a config.json"))
    g = p.add_argument_group("planning options")
    default = f"default: {mesh_default}" if mesh_default else "default: tp=NPROC"
    axes = g.add_mutually_exclusive_group() if world_size else g
    axes.add_argument("--mesh", default=mesh_default, help=f"device mesh axes ({default}); {_MESH_EXAMPLE}")
    if world_size:
        axes.add_argument("--world-size", type=_positive_int, metavar="N", help=(
            "instead of --mesh: compare every dp x tp split of N devices and plan the fastest that fits"))
    g.add_argument("--batch", type=_positive_int, metavar="N", help="batch size per data-parallel rank")
    g.add_argument("--seq", type=_positive_int, metavar="N", help="sequence length")
    g.add_argument("--dtype", help="training dtype: bf16, fp16, fp32, fp8 (default: the model's parameter dtype)")
    g.add_argument("--hardware", help=f"hardware profile: {', '.join(sorted(HARDWARE))} (default: h100-nvlink)")
    g.add_argument("--memory-budget", metavar="BYTES", help="per-device memory limit, e.g. 80GB or 80GiB")
    g.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto",
                   help="shard norms and activations along the sequence (default: auto, the optimizer decides)")
    g.add_argument("--loss-parallel", action="store_true", default=None, help="keep logits vocab-sharded for loss_parallel()")
    g.add_argument("--data-parallel", choices=("fsdp", "ddp"), default=None,
                   help="what the non-tp mesh axes do to parameter/gradient/optimizer memory (default fsdp)")
    g.add_argument("--optimizer", choices=("adamw", "sgd-momentum", "sgd", "none"), default=None,
                   help="optimizer state in the memory model (default adamw: 16 bytes per parameter)")
    g.add_argument("--strict", action="store_true", default=None,
                   help="refuse a plan that leaves a weight unsharded, gathers mid-model or may not fit")


def _subparser(sub: Any, name: str, *, help: str, epilog: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                          epilog="examples:\n" + epilog, formatter_class=_formatter)


def _add_plan(sub: Any) -> None:
    p = _subparser(sub, "plan", help="decide a tensor-parallel plan for a model", epilog=(
        "  shardplan plan llama3-8b --mesh tp=8\n"
        "  shardplan plan llama3-8b --world-size 64 --no-explain\n"
        "  shardplan plan llama3-70b --mesh dp=16,tp=8 --seq 2048 --memory-budget 80GB -o plan.yaml\n"
        "  shardplan plan mypkg.models:build_model --mesh tp=4 --format json\n"
        "  shardplan plan hf:llama --mesh tp=8 --why"))
    _add_model_options(p, world_size=True)
    out = p.add_argument_group("output")
    out.add_argument("--format", choices=("table", "yaml", "json"), help="table (default on stdout), yaml or json")
    out.add_argument("-o", "--output", metavar="FILE", help="write the plan to FILE (YAML, or JSON for .json)")
    out.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    out.add_argument("--why", action="store_true", help="add each rule's reason to the table")
    out.add_argument("--no-explain", action="store_true", help="skip the per-module alternatives (faster)")
    p.set_defaults(func=cmd_plan)


def _add_explain(sub: Any) -> None:
    p = _subparser(sub, "explain", help="show why a module got its style and what the alternatives cost", epilog=(
        "  shardplan explain llama3-8b layers.0.attention.wq --mesh tp=8\n"
        "  shardplan explain gpt2 lm_head --mesh tp=4"))
    _add_model_options(p)
    p.add_argument("fqn", metavar="FQN", help="module name, e.g. layers.0.attention.wq (or its rule, layers.*.attention.wq)")
    p.set_defaults(func=cmd_explain)


def _add_check(sub: Any) -> None:
    p = _subparser(sub, "check", help="validate a plan file against a model", epilog=(
        "  shardplan check plan.yaml llama3-8b\n"
        "exit status: 0 no findings, 1 findings, 2 unusable plan file or model"))
    p.add_argument("plan", metavar="PLAN", help="plan file written by `shardplan plan -o`")
    p.add_argument("model", metavar="MODEL", help="the model spec the plan is for (as for `shardplan plan`)")
    p.set_defaults(func=cmd_check)


def _add_diff(sub: Any) -> None:
    p = _subparser(sub, "diff", help="compare two plan files", epilog=(
        "  shardplan plan llama3-8b --mesh tp=4 -o tp4.yaml\n"
        "  shardplan plan llama3-8b --mesh tp=8 -o tp8.yaml\n"
        "  shardplan diff tp4.yaml tp8.yaml"))
    p.add_argument("plan_a", metavar="PLAN_A")
    p.add_argument("plan_b", metavar="PLAN_B")
    p.set_defaults(func=cmd_diff)


def _add_simulate(sub: Any) -> None:
    p = _subparser(sub, "simulate", help="apply a plan on a fake process group and count its collectives and bytes",
                   epilog=(
        "  shardplan simulate llama3-8b --mesh tp=64\n"
        "  shardplan simulate llama3-debug --plan plan.yaml\n"
        "exit status: 0 counts and logical bytes match the plan's estimate, 1 they differ, 2 unusable input"))
    _add_model_options(p)
    p.add_argument("--plan", metavar="FILE", help="simulate this plan file instead of planning (its mesh is used)")
    p.set_defaults(func=cmd_simulate)


def _add_verify(sub: Any) -> None:
    p = _subparser(sub, "verify", help="run a plan on gloo ranks of this CPU and compare it with the unsharded model",
                   epilog=(
        "  shardplan verify llama3-debug --nproc 2\n"
        "  shardplan plan llama3-debug --mesh tp=4 -o plan.yaml && shardplan verify llama3-debug --plan plan.yaml --nproc 4\n"
        "  shardplan verify mypkg.models:build_small --nproc 2 --sequence-parallel on\n"
        "compares the weights after sharding (exact), the output, a loss and every gradient in float32\n"
        "exit status: 0 all within tolerance, 1 a difference, 2 unusable input or a rank crashed / timed out"))
    _add_model_options(p, mesh_default=None)
    p.add_argument("--plan", metavar="FILE", help="verify this plan file instead of planning (its tp must equal --nproc)")
    p.add_argument("--nproc", type=_positive_int, default=2, metavar="N", help="gloo ranks to run (default: 2)")
    p.add_argument("--timeout", type=_positive_float, default=300.0, metavar="S",
                   help="give up after S seconds, process start-up included (default: 300)")
    p.add_argument("--traceback", action="store_true", help="when a rank fails, print its traceback on stderr")
    p.set_defaults(func=cmd_verify)


def _add_schema(sub: Any) -> None:
    p = _subparser(sub, "schema", help="print the JSON schema of plan files", epilog=(
        "  shardplan schema > plan.schema.json"))
    p.set_defaults(func=cmd_schema)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardplan", formatter_class=_formatter,
        description="Tensor-parallel sharding-plan compiler for PyTorch: trace, cost, solve, emit DTensor plans.",
        epilog=(
            "examples:\n"
            "  shardplan plan llama3-8b --mesh tp=8 -o plan.yaml\n"
            "  shardplan check plan.yaml llama3-8b\n"
            "  shardplan simulate llama3-8b --plan plan.yaml\n"
            "  shardplan verify llama3-debug --nproc 2\n"
            "run `shardplan COMMAND --help` for a command's options and examples"),
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"shardplan {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in (_add_plan, _add_explain, _add_check, _add_diff, _add_simulate, _add_verify, _add_schema):
        add(sub)
    return parser


# --------------------------------------------------------------------------- planning


@contextlib.contextmanager
def _progress(message: str) -> Iterator[None]:
    """A spinner on stderr while the body runs, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def _plan_options(args: argparse.Namespace, *, explain: bool | str) -> dict[str, Any]:
    given = {
        "batch_size": args.batch, "seq_len": args.seq, "dtype": args.dtype, "hardware": args.hardware,
        "memory_budget": args.memory_budget, "loss_parallel": args.loss_parallel,
        "data_parallel": args.data_parallel, "optimizer": args.optimizer, "strict": args.strict,
    }
    opts = {k: v for k, v in given.items() if v is not None}
    opts["sequence_parallel"] = {"auto": None, "on": True, "off": False}[args.sequence_parallel]
    opts["explain"] = explain
    return opts


def _resolve(args: argparse.Namespace, *, device: str = "meta") -> tuple[Any, tuple | None, str]:
    from .tools.sources import resolve_model

    return resolve_model(args.model, device=device, batch_size=args.batch, seq_len=args.seq)


def _make_plan(args: argparse.Namespace, *, explain: bool | str) -> tuple[Any, Any, str]:
    """(plan, model, display name) for the model and options on the command line."""
    import shardplan
    from .tools.sources import plan_traced

    axes = parse_mesh(args.mesh)
    opts = _plan_options(args, explain=explain)
    mesh = ",".join(f"{k}={v}" for k, v in axes.items())
    with _progress(f"tracing and planning {args.model} on {mesh} ..."):
        model, inputs, name = _resolve(args)
        # a small model whose trace needs values its weights decide is built again on the CPU
        plan, model, _ = plan_traced(args.model, model, inputs,
                                     lambda m, i: shardplan.plan_model(m, axes, example_inputs=i, **opts),
                                     batch_size=args.batch, seq_len=args.seq)
    return plan, model, name


def _output_format(args: argparse.Namespace) -> str:
    if args.output is None:
        return args.format or "table"
    if args.format == "table":
        raise ValueError("-o writes a plan file: use --format yaml or --format json (a table goes to stdout)")
    if args.format:
        return args.format
    return "json" if Path(args.output).suffix.lower() == ".json" else "yaml"


def _check_output_path(path: Path, *, force: bool) -> None:
    if path.is_dir():
        raise ValueError(f"-o {path}: is a directory; give a file name, e.g. -o {path / 'plan.yaml'}")
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"-o {path}: {parent} is a file, not a directory; write the plan somewhere else")


def _choose_split(args: argparse.Namespace, *, explain: bool, fmt: str) -> tuple[Any, Any, str]:
    """(plan, model, name) of the split ``--world-size`` chose, after printing every split."""
    from .api import compare_meshes
    from .tools.report import make_console, render_splits

    opts = _plan_options(args, explain=explain)
    with _progress(f"tracing {args.model} and planning each dp x tp split of {args.world_size} devices ..."):
        model, inputs, name = _resolve(args)
        comparison = compare_meshes(model, args.world_size, example_inputs=inputs, **opts)
    # the table is data, but stdout may carry the plan itself
    render_splits(comparison, console=make_console(stderr=fmt != "table" and not args.output))
    return comparison.plan, model, name


def cmd_plan(args: argparse.Namespace) -> int:
    fmt = _output_format(args)
    if args.output:  # fail before the slow part
        _check_output_path(Path(args.output), force=args.force)
    if args.world_size:
        plan, model, name = _choose_split(args, explain=not args.no_explain, fmt=fmt)
    else:
        plan, model, name = _make_plan(args, explain=not args.no_explain)
    if args.output:
        from .plan.fileio import atomic_write

        atomic_write(Path(args.output), plan.to_json() + "\n" if fmt == "json" else plan.to_yaml(), force=args.force)
        step = f", predicted step {_seconds(plan.estimate.step_time_s)}" if plan.estimate else ""
        summary = f"{len(plan.rules)} rules{step}"
        mesh = ",".join(f"{k}={v}" for k, v in plan.mesh.axes.items()) if args.world_size else args.mesh
        print(f"shardplan: wrote the {name} plan for {mesh} to {args.output} ({summary})", file=sys.stderr)
    elif fmt == "table":
        from .tools.report import render_table

        render_table(plan, model=model, show_why=args.why)
    else:
        sys.stdout.write(plan.to_yaml() if fmt == "yaml" else plan.to_json() + "\n")
    return EXIT_OK


def _seconds(s: float) -> str:
    from .decide.cost import format_seconds

    return format_seconds(s)


def cmd_schema(args: argparse.Namespace) -> int:
    from .plan.model import Plan

    print(json.dumps(Plan.model_json_schema(), indent=2))
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from .plan.model import matches
    from .tools.report import decision_table, make_console

    plan, model, name = _make_plan(args, explain=args.fqn)
    names = [fqn for fqn, _ in model.named_modules() if fqn]
    if not any(matches(args.fqn, fqn) for fqn in names):
        raise ValueError(f"{name} has no module {args.fqn!r}; weight modules look like {_examples(plan)}")
    make_console().print(decision_table(plan.explain(args.fqn), fqn=args.fqn))
    return EXIT_OK


def _examples(plan: Any) -> str:
    return ", ".join(repr(r.module) for r in plan.rules[:3])


# --------------------------------------------------------------------------- check


# styles whose output is whole: torch splits the weight unevenly (a 50257-token vocabulary)


def cmd_check(args: argparse.Namespace) -> int:
    from .plan.model import load_plan_with_lines
    from .plan.validate import check_findings

    plan, lines = load_plan_with_lines(args.plan)  # one parse gives the plan and each key's line
    from .tools.sources import resolve_model  # torch: only once the file is known to be a plan

    model, _, name = resolve_model(args.model)
    findings = check_findings(plan, model, where=lambda key: f"{args.plan}:{lines.get(key, 1)}: ")
    for line in findings:
        print(line)
    if findings:
        print(f"shardplan: {len(findings)} finding(s): {args.plan} does not fit {name}", file=sys.stderr)
        return EXIT_FINDINGS
    print(f"ok: {args.plan} fits {name} ({len(plan.rules)} rules, tp={plan.tp})", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace) -> int:
    from .plan.model import load_plan
    from .tools.report import diff_lines

    a, b = load_plan(args.plan_a), load_plan(args.plan_b)
    print(f"--- {args.plan_a}\n+++ {args.plan_b}")
    for line in diff_lines(a, b):
        print(line)
    return EXIT_OK


# --------------------------------------------------------------------------- simulate

_PHASES = ("forward", "backward")
_BYTES_RTOL = 1e-9  # the estimate's logical bytes are floats of exact integer sums


def _simulate_model(args: argparse.Namespace, plan: Any, *, device: str) -> Any:
    """:func:`shardplan.tools.simulate.simulate` on the model the command line names."""
    import torch

    from .api import infer_example_inputs
    from .tools.simulate import simulate

    model, inputs, _ = _resolve(args, device=device)
    if inputs is None:
        # the shape the plan was made for (plan_model's own default is batch 2)
        batch = args.batch or plan.options.batch_size or 2
        inputs = infer_example_inputs(model, batch_size=batch, seq_len=args.seq or plan.options.seq_len or 2048)
        inputs = tuple(torch.zeros(t.shape, dtype=t.dtype, device=device) for t in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate(model, plan, inputs)


def _simulate(args: argparse.Namespace, plan: Any) -> Any:
    try:
        return _simulate_model(args, plan, device="meta")
    except (RuntimeError, NotImplementedError) as exc:
        if plan.model.num_params > _CPU_FALLBACK_PARAMS:
            raise ValueError(f"running {args.model} on meta tensors under the fake process group failed: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    try:
        return _simulate_model(args, plan, device="cpu")
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"running {args.model} under the fake process group failed (meta and CPU): "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _bytes_match(counted: float, predicted: float | None) -> bool:
    return predicted is not None and abs(counted - predicted) <= _BYTES_RTOL * max(1.0, abs(predicted))


def _bytes_cell(n: float | None, other: float | None) -> str:
    from .decide.cost import format_bytes

    if n is None:
        return "-"
    return format_bytes(n) if _bytes_match(n, other) else f"{n:,.0f} B"  # exact when they differ


_UPPER_BOUND_START = "sizes that depend on tensor values"  # analyze.values.UPPER_BOUND_NOTE (no torch import here)


def _simulation_table(result: Any, plan: Any) -> tuple[Any, bool]:
    """Counted vs predicted collectives (per kind) and logical bytes, per phase; and whether all match."""
    from rich.table import Table

    table = Table(title="collectives: counted vs predicted", title_justify="left")
    for col in ("phase", "collective", "counted", "predicted", "match"):
        table.add_column(col, justify="right" if col in ("counted", "predicted") else "left")
    predicted_bytes = plan.estimate.collective_bytes
    # sizes the trace could only bound (MoE dispatch by value): the prediction is a ceiling
    bound = any(w.startswith(_UPPER_BOUND_START) for w in plan.warnings)
    bytes_ok = True
    for phase in _PHASES:
        c, p = result.counted.get(phase, {}), result.predicted.get(phase, {})
        for kind in sorted(k for k in set(c) | set(p) if c.get(k, 0) or p.get(k, 0)):
            same = c.get(kind, 0) == p.get(kind, 0)
            table.add_row(phase, kind, str(c.get(kind, 0)), str(p.get(kind, 0)), "ok" if same else "DIFFERS")
        got, want = result.counted_bytes.get(phase, 0), predicted_bytes.get(phase)
        same = _bytes_match(got, want) or (bound and want is not None and got <= want)
        bytes_ok &= same
        table.add_row(phase, "logical bytes", _bytes_cell(got, want), _bytes_cell(want, got),
                      "ok" if same else "DIFFERS" if want is not None else "not in plan", end_section=True)
    return table, result.matches and bytes_ok


def _plan_shapes(args: argparse.Namespace, plan: Any) -> None:
    """Simulate a plan file at the batch and sequence it was made for (its byte estimate's)."""
    for flag, attr, recorded in (("--batch", "batch", plan.options.batch_size), ("--seq", "seq", plan.options.seq_len)):
        given = getattr(args, attr)
        if given is not None and recorded is not None and given != recorded:
            raise ValueError(f"{flag} {given} differs from the {recorded} {args.plan} was planned for; "
                             f"its estimate is for its own shapes: drop {flag}")
        if given is None:
            setattr(args, attr, recorded)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .plan.model import load_plan
    from .tools.report import make_console

    if args.plan:
        plan = load_plan(args.plan)
        _plan_shapes(args, plan)
    else:
        plan = _make_plan(args, explain=False)[0]
    if plan.estimate is None:
        raise ValueError(f"{args.plan or 'the plan'} records no estimate to compare the counts with; re-plan it")
    with _progress(f"simulating {args.model} on a fake process group ..."):
        result = _simulate(args, plan)
    table, ok = _simulation_table(result, plan)
    make_console().print(table)
    if not ok:
        print("shardplan: the counted collectives or their bytes differ from the plan's estimate", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FINDINGS


# --------------------------------------------------------------------------- verify


def _verify_options(args: argparse.Namespace) -> dict[str, Any]:
    """The planning options given on the command line (none may be given with --plan)."""
    opts = _plan_options(args, explain=False)
    opts = {k: v for k, v in opts.items() if k not in ("explain", "batch_size", "seq_len")}
    if opts.get("sequence_parallel") is None:
        opts.pop("sequence_parallel", None)
    return opts


def cmd_verify(args: argparse.Namespace) -> int:
    from .plan.model import load_plan
    from rich.text import Text

    from .tools.report import make_console, verify_lines, verify_table
    from .tools.verify import VerifyError, verify

    opts = _verify_options(args)
    if args.plan:
        if args.mesh is not None or opts:
            given = ["--mesh"] * (args.mesh is not None) + [f"--{k.replace('_', '-')}" for k in opts]
            raise ValueError(f"{', '.join(given)}: planning options do not apply to --plan {args.plan}; "
                             "the plan file fixes its mesh and options")
        plan, mesh = load_plan(args.plan), None
    else:
        plan, mesh = None, parse_mesh(args.mesh) if args.mesh else None
    sizes = {"batch_size": args.batch} if args.batch else {}
    mesh_text = args.mesh or f"tp={args.nproc}"
    try:
        with _progress(f"verifying {args.model} ({mesh_text}) on {args.nproc} gloo ranks ..."):
            result = verify(args.model, plan=plan, nproc=args.nproc, mesh=mesh, timeout_s=args.timeout,
                            seq_len=args.seq, **sizes, **opts)
    except VerifyError as exc:
        if args.traceback and exc.details:
            print(exc.details.rstrip(), file=sys.stderr)
        hint = "" if args.traceback else " (--traceback shows it in full)"
        raise ValueError(f"verify could not finish: {exc}{hint}") from exc
    console = make_console()
    console.print(verify_table(result))
    for line in verify_lines(result):
        console.print(Text(line), soft_wrap=True)
    if not result.passed:
        print(f"shardplan: the sharded {result.model} differs from the unsharded model (see above)", file=sys.stderr)
    return EXIT_OK if result.passed else EXIT_FINDINGS


# --------------------------------------------------------------------------- main


def _print_error(exc: BaseException) -> None:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
    print(f"shardplan: error: {lines[0]}", file=sys.stderr)
    if len(lines) > 1:
        print("  " + "; ".join(lines[1:]), file=sys.stderr)


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(args)
    except BrokenPipeError:  # `shardplan schema | head`: stop quietly, as a SIGPIPE'd tool would
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError) as exc:  # FileExistsError, FileNotFoundError, PermissionError, ...
        _print_error(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or a model that breaks a step: one line unless asked for more
        if os.environ.get(_TRACEBACK_ENV):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"shardplan: error: internal error: {type(exc).__name__}: {first}", file=sys.stderr)
        print(f"  set {_TRACEBACK_ENV}=1 to see the traceback, and please report it", file=sys.stderr)
        return EXIT_USAGE


FAST_EXIT = True  # False: entry() raises SystemExit (a harness running ``python -m shardplan`` in-process)


def entry() -> None:
    """``shardplan`` and ``python -m shardplan``: :func:`main`, then exit with its status."""
    code = main()
    if not FAST_EXIT:
        raise SystemExit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # `shardplan plan ... | head` closed the pipe before the flush
        code = 141
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs; the module teardown after it is skipped
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the command line in ``argv``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _run(args.func, args)
