"""Verify: run a plan on real gloo ranks of this machine and compare it with the unsharded model.

Contract
--------
``verify(model_spec, *, plan=None, nproc=2, mesh=None, timeout_s=300.0, batch_size=2,
seq_len=None, max_params=MAX_PARAMS, **plan_options) -> VerifyResult``

* ``model_spec`` is any spec :func:`shardplan.tools.sources.resolve_model` takes: a preset name
  (``llama3-debug``), ``package.module:callable`` or a Hugging Face ``config.json`` path.
  ``hf:<model_type>`` names a default-size model and is refused by the size limit below
  unless ``max_params`` is raised.
* Without ``plan``, the model is planned here (meta device, no process group) by
  :func:`shardplan.plan_model` on ``mesh`` (default ``{"tp": nproc}``) with
  ``explain=False`` and ``plan_options``. With ``plan``, its fingerprint must equal the
  model's and no ``mesh``/``plan_options`` may be given.
* The plan's tensor-parallel degree must equal ``nproc``: verification runs the tp axis
  only, on a 1-D mesh named after the plan's tp axis (data-parallel axes replicate and are
  not exercised). An expert-parallel plan runs on ``ep x tp`` ranks instead (``--mesh
  ep=2``), each ep rank its own rows of the batch (a multiple of ep): its output and the mean
  of the ranks' losses are compared with the whole batch's, and the gradients after the
  dense ones are averaged over ep, as data parallelism would. Every problem with the inputs (bad spec, fingerprint, ``nproc``, size)
  raises ``ValueError`` before any process starts.
* ``shardplan.tools.launch.run_on_gloo`` then starts ``nproc`` ranks. Each builds the model twice
  on CPU from the same seed (``torch.manual_seed(0)`` around ``resolve_model(spec,
  device="cpu")``; presets build through ``build_preset(name, device="cpu", seed=0)``),
  converts both to float32 if they are not, applies the plan to one copy with
  :func:`shardplan.apply.emit.apply_plan`, runs the same example inputs through both (made once,
  in the parent: the preset's own fixed batch, else random inputs shaped as
  ``plan_model`` infers them, ``seq_len`` 16 unless given; dropout as the identity in both,
  :class:`NoDropout`, since a rank's mask of its shard cannot equal one process's), and compares

  ==========  =====================================================================
  ``weights`` every parameter after ``apply_plan``, gathered, vs the reference: exact
  ``output``  the forward output (``.logits``, first tensor of a tuple/dict), gathered
  ``loss``    cross-entropy against fixed random targets when the input is token ids
              and the output is per-token logits, else the mean of squared outputs
  ``grad``    every parameter's gradient after ``loss.backward()`` (``full_tensor()``;
              a tied weight once; a packed parameter's global view is already the
              module's own order, see :func:`shardplan.apply.styles.packed_placement`)
  ==========  =====================================================================

  with float32 tolerances ``|tp - ref| <= atol + rtol * max|ref|`` per tensor
  (:data:`TOLERANCES`, the numbers of ``tests/test_numerics.py``). Structural problems
  (parameter names that differ, a gradient missing or left ``Partial``, non-finite or
  mis-shaped results) are listed in ``VerifyResult.problems`` and fail the run.
* ``VerifyResult`` holds one :class:`Row` per quantity (worst over all ranks: max abs
  difference, its tolerance, where, pass), the worst parameter gradient, the largest
  gradient differences, the problems, and ``passed``.
* It never hangs: a rank that raises or dies (``RankError``) or a run past ``timeout_s``
  (``RankTimeout``, process start-up included) becomes :class:`VerifyError`, whose message
  is one line naming the rank and its exception (``details`` holds the traceback).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..plan.model import Plan

__all__ = ["verify", "VerifyResult", "Row", "VerifyError", "TOLERANCES", "MAX_PARAMS", "compare"]

# Float32, (atol, rtol): a tensor passes when every |tp - ref| <= atol + rtol * max|ref|.
# The relative part scales with the tensor's largest value, not each element's: a summed
# gradient (cls/pos tokens, biases) rounds at the size of its largest terms, so an element
# that sums to near 0 still carries their rounding. Per element, tests.portability's ViT
# failed on one BLAS kernel and passed on another (cls grad |diff| 4.8e-6 at max|grad| 5.0).
# From tests/test_numerics.py (measured on a 2-core x86 CPU, torch 2.13, 1 thread per rank,
# each ~10-20x the worst value seen): a row-parallel Linear sums tp partial dot products and
# all-reduces them, the reference does one matmul over the whole inner dimension, so the
# float32 reduction order differs by a few ulps per layer, in the forward (output worst
# 8.3e-7 at |logits| <= 2.5; loss worst 4.8e-7, one ulp of ~6.4) and in the backward matmuls
# and gradient all-reduces (grad worst 1.3e-7 at |grad| <= 0.33). The relative part keeps
# the check meaningful for models whose outputs or gradients are larger than those. Sharding
# a weight and gathering it back moves no bits: ``weights`` is exact. On an AMD EPYC (another
# BLAS kernel) CLIP's text position-embedding gradient differed by 3.9e-6 at max|grad| 0.70
# (its contrastive loss scales normalized features by exp(logit_scale) = 14.3), past 2e-6 +
# 2e-6 * max|grad|: the gradient tolerance is 5e-6 + 5e-6 * max|grad|.
TOLERANCES: dict[str, tuple[float, float]] = {
    "weights": (0.0, 0.0),
    "output": (1e-5, 1e-5),
    "loss": (1e-5, 1e-5),
    "grad": (5e-6, 5e-6),
}
QUANTITIES = tuple(TOLERANCES)
# each rank holds two float32 copies with gradients (~16 bytes a parameter) plus activations
MAX_PARAMS = 200_000_000
_DEFAULT_SEQ_LEN = 16  # for non-preset models: plan_model's 2048 would only make the check slow
_TARGET_SEED = 4321
_FORWARD_SEED = 2024
_TOP = 3


class VerifyError(RuntimeError):
    """A verification run that produced no answer: a rank raised or died, or it timed out.

    ``str(err)`` is one line; ``details`` is the failing rank's traceback (or the timeout
    note); ``rank`` the first rank that failed (``None`` for a timeout)."""

    def __init__(self, message: str, *, details: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.details = details
        self.rank = rank


@dataclass
class Row:
    """One compared quantity, worst over every rank and every tensor of it."""

    quantity: str
    max_abs: float  # max |tp - ref|
    atol: float
    rtol: float
    passed: bool
    where: str = ""  # the tensor holding max_abs (a parameter name for weights/grad)
    ratio: float = 0.0  # worst |tp - ref| / (atol + rtol max|ref|); <= 1 passes
    count: int = 0  # tensors compared

    @property
    def tolerance(self) -> str:
        if not (self.atol or self.rtol):
            return "exact"
        return f"{self.atol:.0e}" + (f" + {self.rtol:.0e}*max|ref|" if self.rtol else "")


@dataclass
class VerifyResult:
    model: str
    plan: Plan
    nproc: int
    rows: list[Row]
    worst_param: str | None = None  # the gradient nearest to (or furthest past) its tolerance
    worst_param_diff: float = 0.0
    top_grads: list[tuple[str, float]] = field(default_factory=list)  # largest |grad diffs|
    problems: list[str] = field(default_factory=list)
    sharded_params: int = 0
    num_params: int = 0  # parameter tensors compared
    seconds: float = 0.0
    inputs: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.rows)

    def row(self, quantity: str) -> Row:
        return next(r for r in self.rows if r.quantity == quantity)

    def summary(self) -> str:
        """One line: PASS/FAIL, the plan and the worst quantity."""
        mesh = f"tp={self.plan.tp}" + (f", {self.plan.mesh.ep_axis}={self.plan.ep}" if self.plan.ep > 1 else "")
        head = f"{self.model} with its {mesh} plan on {self.nproc} gloo ranks"
        if self.passed:
            worst = f" (worst gradient {self.worst_param}: {self.worst_param_diff:.1e})" if self.worst_param else ""
            return f"PASS: {head} matches the unsharded model{worst}"
        failed = [r.quantity for r in self.rows if not r.passed]
        what = ", ".join(failed) + (" and " if failed and self.problems else "") + (
            f"{len(self.problems)} problem(s)" if self.problems else "")
        return f"FAIL: {head} differs from the unsharded model: {what}"


class NoDropout(TorchFunctionMode):
    """Dropout as the identity, in both models: a rank drops other elements of its shard than
    one process drops of the whole tensor (another shape, another draw), so the masks could
    never agree; the plan's math is what is compared. ``scaled_dot_product_attention`` runs
    with ``dropout_p=0``."""

    _DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                           "feature_alpha_dropout", "dropout_", "feature_dropout"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self._DROPOUTS and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "scaled_dot_product_attention" and kwargs.get("dropout_p"):
            kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- comparison


def compare(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], atol: float, rtol: float) -> dict[str, Any]:
    """Worst difference over ``(name, got, want)`` pairs.

    Returns ``max_abs`` (and ``where``), ``ratio`` (worst ``|d| / (atol + rtol max|want|)``,
    ``inf`` where a tolerance of 0 is exceeded), ``passed``, ``per`` (name -> max abs,
    ratio) and ``problems`` (shape mismatches, non-finite values)."""
    per: dict[str, tuple[float, float]] = {}
    problems: list[str] = []
    for name, got, want in pairs:
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: sharded result has shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
            per[name] = (math.inf, math.inf)
            continue
        g, w = got.detach().double(), want.detach().double()
        bad = [who for who, t in (("sharded", g), ("reference", w)) if not torch.isfinite(t).all()]
        if bad:
            problems.append(f"{name}: the {' and the '.join(bad)} result has non-finite values")
            per[name] = (math.inf, math.inf)
            continue
        if g.numel() == 0:
            per[name] = (0.0, 0.0)
            continue
        d = (g - w).abs()
        tol = atol + rtol * float(w.abs().max())
        worst = float(d.max())
        per[name] = (worst, 0.0 if worst == 0 else worst / max(tol, 1e-300))
    if not per:
        return {"max_abs": 0.0, "where": "", "ratio": 0.0, "passed": True, "per": {}, "problems": problems, "count": 0}
    where = max(per, key=lambda n: per[n][0])
    where = where if per[where][0] > 0 else ""
    ratio = max(r for _, r in per.values())
    return {
        "max_abs": per[where][0] if where else 0.0, "where": where, "ratio": ratio,
        "passed": ratio <= 1.0 and not problems, "per": per, "problems": problems, "count": len(per),
    }


# --------------------------------------------------------------------------- parent


def verify(
    model_spec: str,
    *,
    plan: Plan | None = None,
    nproc: int = 2,
    mesh: Mapping[str, int] | None = None,
    timeout_s: float = 300.0,
    batch_size: int = 2,
    seq_len: int | None = None,
    max_params: int = MAX_PARAMS,
    **plan_options: Any,
) -> VerifyResult:
    """Apply the plan on ``nproc`` gloo ranks and compare with the unsharded model; see the module doc."""
    from .launch import RankError, RankTimeout, run_on_gloo
    from ..plan.model import fingerprint
    from .sources import plan_traced, preset_name, real_inputs, resolve_model

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    preset = preset_name(model_spec)
    seq = seq_len if seq_len is not None or preset else _DEFAULT_SEQ_LEN
    model, meta_inputs, name = resolve_model(model_spec, device="meta", batch_size=batch_size, seq_len=seq)
    if meta_inputs is None:
        from ..api import infer_example_inputs

        meta_inputs = infer_example_inputs(model, batch_size=batch_size, seq_len=seq or _DEFAULT_SEQ_LEN)
    if plan is None:
        plan, model, meta_inputs = plan_traced(
            model_spec, model, meta_inputs, lambda m, i: _plan(m, i, name, nproc=nproc, mesh=mesh, options=plan_options),
            batch_size=batch_size, seq_len=seq)
    else:
        if mesh is not None or plan_options:
            given = (["mesh"] if mesh is not None else []) + sorted(plan_options)
            raise ValueError(f"planning options ({', '.join(given)}) apply only when no plan is given; "
                             "the plan fixes its mesh and options")
        got = fingerprint(model)
        if got != plan.model.fingerprint:
            raise ValueError(f"the plan is for a {plan.model.class_name} with {plan.model.fingerprint}, but {name} is a "
                             f"{type(model).__name__} with {got}; re-plan it with `shardplan plan {model_spec}`")
    if plan.ep > 1:
        _check_expert_run(plan, nproc, batch_size)
    elif plan.tp != nproc:
        raise ValueError(f"the plan's tensor-parallel degree is tp={plan.tp} but nproc={nproc}; verify runs the tp axis "
                         f"on nproc ranks: use nproc={plan.tp} or plan for tp={nproc}")
    num_params = sum(p.numel() for p in model.parameters())
    if num_params > max_params:
        per_rank = num_params * 16
        raise ValueError(
            f"{name} has {num_params / 1e9:.2f}B parameters: verify builds it whole twice in float32 on each of "
            f"{nproc} CPU ranks (~{per_rank / 2**30:.0f} GiB each, limit {max_params / 1e6:.0f}M parameters); "
            "verify a small model of the same structure: a debug preset such as llama3-debug, or a "
            "config.json / package.module:callable that builds one")
    inputs = real_inputs(preset, model, meta_inputs, batch_size=batch_size, seq_len=seq)
    del model
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardplan-verify-") as logs:
        try:
            ranks = run_on_gloo(_verify_rank, world_size=nproc, timeout_s=timeout_s,
                                args=(model_spec, plan.to_yaml(), inputs, TOLERANCES, logs))
        except RankTimeout as exc:
            raise VerifyError(
                f"timed out after {timeout_s:g}s with ranks {list(exc.ranks)} still running "
                "(a rank stuck in a collective, or a model too slow on CPU); raise the timeout or try a smaller model",
                details=str(exc) + _log_tail(logs, exc.ranks[0] if exc.ranks else 0)) from exc
        except RankError as exc:
            raise VerifyError(f"rank {exc.rank} of {nproc} failed: {_last_line(exc.traceback_text)}",
                              details=exc.traceback_text + _log_tail(logs, exc.rank), rank=exc.rank) from exc
    result = _merge(ranks, name=name, plan=plan, nproc=nproc)
    result.seconds = time.perf_counter() - t0
    result.inputs = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
    return result


def _check_expert_run(plan: Plan, nproc: int, batch_size: int) -> None:
    """An expert-parallel plan runs on ep x tp ranks, each ep rank its own rows of the batch."""
    if plan.ep * plan.tp != nproc:
        raise ValueError(f"the plan splits experts over {plan.mesh.ep_axis}={plan.ep} with tp={plan.tp}, "
                         f"{plan.ep * plan.tp} ranks, but nproc={nproc}; use nproc={plan.ep * plan.tp}")
    if batch_size % plan.ep:
        raise ValueError(f"batch {batch_size} does not split over {plan.mesh.ep_axis}={plan.ep} (each ep rank its own "
                         f"rows); use a batch that is a multiple of {plan.ep}")


def _plan(model: nn.Module, inputs: tuple, name: str, *, nproc: int, mesh: Mapping[str, int] | None,
          options: dict[str, Any]) -> Plan:
    from ..api import mesh_axes, plan_model

    axes = {"tp": nproc} if mesh is None else mesh_axes(mesh)
    options = {"explain": False, **options}
    return plan_model(model, axes, example_inputs=inputs, **options)


def _log_tail(logs: str, rank: int, lines: int = 20) -> str:
    try:
        text = (Path(logs) / f"rank{rank}.log").read_text(errors="replace")
    except OSError:
        return ""
    tail = [ln for ln in text.splitlines() if ln.strip()][-lines:]
    return f"\nrank {rank} stderr (last {len(tail)} lines):\n" + "\n".join(tail) if tail else ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no traceback recorded"


def _merge(ranks: list[dict[str, Any]], *, name: str, plan: Plan, nproc: int) -> VerifyResult:
    rows = []
    for q in QUANTITIES:
        worst_rank = max(ranks, key=lambda r: (r[q]["ratio"], r[q]["max_abs"]))
        res = worst_rank[q]
        rows.append(Row(q, res["max_abs"], *TOLERANCES[q], passed=all(r[q]["passed"] for r in ranks),
                        where=res["where"], ratio=res["ratio"], count=res["count"]))
    grads: dict[str, tuple[float, float]] = {}
    for r in ranks:
        for n, (d, ratio) in r["grad"]["per"].items():
            old = grads.get(n, (0.0, 0.0))
            grads[n] = (max(old[0], d), max(old[1], ratio))
    problems: list[str] = []
    for rank, r in enumerate(ranks):
        for p in r["problems"]:
            text = p if nproc == 1 or all(p in other["problems"] for other in ranks) else f"rank {rank}: {p}"
            if text not in problems:
                problems.append(text)
    worst = max(grads, key=lambda n: (grads[n][1], grads[n][0])) if grads else None
    return VerifyResult(
        model=name, plan=plan, nproc=nproc, rows=rows,
        worst_param=worst, worst_param_diff=grads[worst][0] if worst else 0.0,
        top_grads=sorted(((n, d) for n, (d, _) in grads.items()), key=lambda kv: -kv[1])[:_TOP],
        problems=problems, sharded_params=ranks[0]["sharded_params"], num_params=ranks[0]["num_params"],
    )


# --------------------------------------------------------------------------- ranks


def _build(spec: str) -> nn.Module:
    from .sources import resolve_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, _, _ = resolve_model(spec, device="cpu", batch_size=1, seq_len=1)
    return model


def _as_float32(model: nn.Module) -> nn.Module:
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model.float()
    return model


def _output_tensor(out: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if hasattr(out, "logits") and out.logits is not None:
        out = out.logits
    elif isinstance(out, Mapping):
        out = next((v for v in out.values() if isinstance(v, torch.Tensor)), None)
    elif isinstance(out, (tuple, list)):
        out = next((v for v in out if isinstance(v, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}; verify needs a tensor, a tuple/dict holding one, "
                        "or an output with .logits")
    return out.full_tensor() if isinstance(out, DTensor) else out


def _loss(out: torch.Tensor, inputs: tuple, rows: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """``rows``: (i, n), the i-th of n slices of the batch that ``out`` and ``inputs`` are
    (an ep rank's); the targets are that slice of the whole batch's."""
    x = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    lm = (x is not None and x.dtype == torch.long and out.is_floating_point() and out.dim() == x.dim() + 1
          and tuple(out.shape[:-1]) == tuple(x.shape))
    if lm:
        gen = torch.Generator().manual_seed(_TARGET_SEED)
        whole = (x.shape[0] * rows[1],) + tuple(x.shape[1:])
        target = torch.randint(0, out.shape[-1], whole, generator=gen).chunk(rows[1])[rows[0]]
        return torch.nn.functional.cross_entropy(out.float().flatten(0, -2), target.flatten())
    return out.float().pow(2).mean()


def _rows(inputs: tuple, rows: tuple[int, int]) -> tuple:
    """This ep rank's slice of every batched input."""
    i, n = rows
    return tuple(t.chunk(n)[i] if isinstance(t, torch.Tensor) and t.dim() and n > 1 else t for t in inputs)


def _data_mean(t: torch.Tensor, mesh: Any, rows: tuple[int, int]) -> torch.Tensor:
    if rows[1] == 1:
        return t
    t = t.clone()
    torch.distributed.all_reduce(t, group=mesh.get_group(0))
    return t / rows[1]


def _average_dense_grads(model: nn.Module, mesh: Any, plan: Plan) -> None:
    """Every gradient but the experts' averaged over ep, as data parallelism would (the experts'
    come out of their style already so)."""
    from torch.distributed.tensor import DTensor

    from ..apply.experts_listed import held_here

    listed = held_here(model)
    for name, p in model.named_parameters():
        g = p.grad
        if g is None or name in listed or (
                isinstance(p, DTensor) and plan.mesh.ep_axis in (p.device_mesh.mesh_dim_names or ())):
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        torch.distributed.all_reduce(local, group=mesh.get_group(0))
        local /= plan.ep


def _gathered(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _quiet_stderr(path: Path) -> None:
    """Send this rank's stderr (warnings, and launch's traceback echo) to a log file: the
    parent reports a failure in one line and keeps the traceback in ``VerifyError.details``."""
    fh = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the rank process
    sys.stderr.flush()
    os.dup2(fh.fileno(), 2)
    sys.stderr = fh


def _verify_rank(rank: int, world_size: int, spec: str, plan_yaml: str, inputs: tuple,
                 tols: dict[str, tuple[float, float]], logs: str | None = None) -> dict[str, Any]:
    """One gloo rank: build twice, shard one copy, compare forward, loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ..apply.emit import apply_plan, check_fingerprint
    from ..apply.experts_listed import held_elsewhere

    if logs is not None:
        _quiet_stderr(Path(logs) / f"rank{rank}.log")

    plan = Plan.from_yaml(plan_yaml)
    if plan.ep > 1:  # experts over ep (a data axis for the rest), tp inside
        names = (plan.mesh.ep_axis, plan.mesh.tp_axis)
        mesh = init_device_mesh("cpu", (plan.ep, plan.tp), mesh_dim_names=names)
        rows = (mesh.get_coordinate()[0], plan.ep)
    else:
        mesh, rows = init_device_mesh("cpu", (world_size,), mesh_dim_names=(plan.mesh.tp_axis,)), (0, 1)
    ref, tp = _build(spec), _build(spec)
    check_fingerprint(tp, plan)
    for (n, a), (_, b) in zip(ref.state_dict().items(), tp.state_dict().items()):
        if not torch.equal(a, b):
            raise RuntimeError(f"two builds of {spec} differ at {n}: the model is not deterministic under torch.manual_seed(0)")
    _as_float32(ref), _as_float32(tp)
    apply_plan(tp, mesh, plan, check=False)

    ref_params, tp_params = dict(ref.named_parameters()), dict(tp.named_parameters())
    problems = []
    elsewhere = held_elsewhere(tp)  # experts written as a list: each rank compares those it holds
    if sorted(set(ref_params) - set(elsewhere)) != sorted(tp_params):
        missing, extra = sorted(set(ref_params) - set(tp_params)), sorted(set(tp_params) - set(ref_params))
        problems.append(f"parameter names changed: missing {missing[:3]}, new {extra[:3]}")
    common = [n for n in ref_params if n in tp_params]

    res: dict[str, Any] = {}
    with torch.no_grad():
        res["weights"] = compare([(n, _gathered(tp_params[n]), ref_params[n]) for n in common], *tols["weights"])

    # one random stream each, from one seed: random ops on whole values (a Gumbel router in
    # training mode, phimoe's sparsemixer) draw the same numbers in both models
    torch.manual_seed(_FORWARD_SEED)
    with NoDropout():
        out_ref = _output_tensor(ref(*inputs))
    mine = _rows(inputs, rows)
    torch.manual_seed(_FORWARD_SEED)
    with NoDropout():
        out_tp = _output_tensor(tp(*mine))
    res["output"] = compare([("output", out_tp, out_ref.chunk(rows[1])[rows[0]])], *tols["output"])
    loss_ref, loss_tp = _loss(out_ref, inputs), _loss(out_tp, mine, rows)
    res["loss"] = compare([("loss", _data_mean(loss_tp.detach(), mesh, rows), loss_ref)], *tols["loss"])
    loss_ref.backward()
    loss_tp.backward()
    if rows[1] > 1:
        _average_dense_grads(tp, mesh, plan)

    pairs = []
    for n in common:
        g_ref, g_tp = ref_params[n].grad, tp_params[n].grad
        if g_ref is None and g_tp is None:
            continue
        if g_tp is None or g_ref is None:
            problems.append(f"{n}: gradient missing on the {'sharded' if g_tp is None else 'reference'} model")
            continue
        if isinstance(g_tp, DTensor) and any(p.is_partial() for p in g_tp.placements):
            problems.append(f"{n}: gradient left Partial after backward (an optimizer would step on a partial sum)")
        pairs.append((n, _gathered(g_tp), g_ref))
    res["grad"] = compare(pairs, *tols["grad"])
    for q in QUANTITIES:
        problems += [p for p in res[q].pop("problems") if p not in problems]
    res["problems"] = problems
    res["num_params"] = len(common)
    # a rank holding less than the whole: Shard, a packed weight's _StridedShard (is_shard()
    # is False for it), kv heads held by their group
    res["sharded_params"] = sum(
        1 for p in tp_params.values() if isinstance(p, DTensor) and p.to_local().numel() < p.numel())
    return res
