"""Spawn-importable worker for ``tests/test_numerics.py``.

``run_cases(rank, world_size, cases, tols)`` runs on every gloo rank (see
``shardplan.tools.launch.run_on_gloo``). For each case it rebuilds the plan from its
YAML text, builds a float32 reference model and an identical copy on CPU, applies
the plan to the copy on a 1-D ``("tp",)`` mesh, and runs forward, a scalar loss,
backward, one AdamW step and a second forward on both. It returns, per case, the
worst differences per category (TP vs reference), so the parent can assert.

Kept apart from the test module so the spawned children import neither pytest
nor the test module itself.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from tests._checks import parameter_checks
from shardplan.models.presets import build_preset, get_preset

_TARGET_SEED = 4321  # fixed targets: identical on every rank and in the reference
LR = 1e-2

CATEGORIES = ("out", "loss", "grad", "param", "step", "out_after_step", "out_after_step_vs_ref")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _targets(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_TARGET_SEED)
    if x.dtype == torch.long:  # language model: next-token-style class targets
        return torch.randint(0, out.shape[-1], x.shape, generator=gen)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return F.cross_entropy(out.flatten(0, -2), target.flatten())
    return F.mse_loss(out, target)


def _compare(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], atol: float, rtol: float) -> dict[str, Any]:
    """Worst |tp - ref| over ``pairs``; ``ratio`` <= 1 means every element is within
    ``atol + rtol * |ref|`` (the ``torch.testing.assert_close`` rule)."""
    per: dict[str, float] = {}
    ratios: dict[str, float] = {}
    scale = 0.0
    for name, got, want in pairs:
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{name}: TP shape {tuple(got.shape)} != reference {tuple(want.shape)}")
        if not torch.isfinite(got).all():
            raise AssertionError(f"{name}: TP result has non-finite values")
        g, w = got.detach().double(), want.detach().double()
        d = (g - w).abs()
        per[name] = float(d.max()) if d.numel() else 0.0
        ratios[name] = float((d / (atol + rtol * w.abs())).max()) if d.numel() else 0.0
        scale = max(scale, float(w.abs().max()) if w.numel() else 0.0)
    worst = max(per, key=per.get)
    worst_ratio = max(ratios, key=ratios.get)
    return {
        "max_abs": per[worst], "worst": worst,
        "ratio": ratios[worst_ratio], "ratio_worst": worst_ratio,
        "top": sorted(per.items(), key=lambda kv: -kv[1])[:3],
        "ref_scale": scale, "count": len(per),
    }



def _run_case(case: dict[str, Any], mesh, tols: dict[str, tuple[float, float]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    name = case["name"]
    preset = get_preset(name)
    plan = shardplan.Plan.from_yaml(case["plan_yaml"])
    checks: dict[str, Any] = {"plan_batch_size": plan.options.batch_size}

    ref = build_preset(name, device="cpu", seed=0)
    tp = build_preset(name, device="cpu", seed=0)
    for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        if a.dtype != torch.float32 or not torch.equal(a, b):
            raise AssertionError(f"{n}: the two builds differ before apply_plan (seeded build is not deterministic)")
    shardplan.apply_plan(tp, mesh, plan)

    checks.update(parameter_checks(ref, tp))
    ref_params = dict(ref.named_parameters())  # remove_duplicate=True: a tied weight once
    tp_params = dict(tp.named_parameters())

    (x,) = preset.example_inputs(batch_size=case["batch_size"], device="cpu")
    out_ref = ref(x)
    out_tp = tp(x)
    checks["out_is_dtensor"] = isinstance(out_tp, DTensor)
    target = _targets(out_ref, x)
    loss_ref = _loss(out_ref, target)
    loss_ref.backward()
    if isinstance(out_tp, DTensor):  # loss_parallel plans hand back vocab-sharded logits
        with loss_parallel():
            loss_tp = _loss(out_tp, target)
            loss_tp.backward()
        loss_tp = _full(loss_tp)
    else:
        loss_tp = _loss(out_tp, target)
        loss_tp.backward()
    out_tp = _full(out_tp)

    res: dict[str, Any] = {"checks": checks}
    res["out"] = _compare([("output", out_tp, out_ref)], *tols["out"])
    res["loss"] = _compare([("loss", loss_tp, loss_ref)], *tols["loss"])
    res["loss"]["value"] = loss_ref.item()

    missing_grads = sorted(n for n, p in tp_params.items() if p.grad is None)
    checks["missing_grads"] = missing_grads + sorted(n for n, p in ref_params.items() if p.grad is None)
    checks["partial_grads"] = sorted(
        n for n, p in tp_params.items()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )
    common = [n for n in ref_params if n in tp_params and tp_params[n].grad is not None and ref_params[n].grad is not None]
    res["grad"] = _compare([(n, _full(tp_params[n].grad), ref_params[n].grad) for n in common], *tols["grad"])

    # "step" model: the unsharded model, given the TP model's own (gathered) gradients.
    # TP-after-step vs this isolates the sharded optimizer step and the sharded forward
    # after it from the AdamW amplification of gradient roundoff (see test_numerics.py).
    stepped = build_preset(name, device="cpu", seed=0)
    stepped_params = dict(stepped.named_parameters())
    for n in common:
        stepped_params[n].grad = _full(tp_params[n].grad).detach().clone()
    initial = {n: p.detach().clone() for n, p in stepped_params.items()}

    opts = [torch.optim.AdamW(m.parameters(), lr=LR, foreach=True) for m in (ref, tp, stepped)]
    for opt in opts:
        opt.step()
    with torch.no_grad():
        full_after = {n: _full(tp_params[n]) for n in common}
        res["param"] = _compare([(n, full_after[n], ref_params[n]) for n in common], *tols["param"])
        res["step"] = _compare([(n, full_after[n], stepped_params[n]) for n in common], *tols["step"])
        # the step must have moved every weight (else "param" compares initial values)
        checks["unmoved_params"] = sorted(n for n in common if torch.equal(ref_params[n], initial[n]))
        out2_tp = _full(tp(x))
        res["out_after_step"] = _compare([("output", out2_tp, stepped(x))], *tols["out_after_step"])
        res["out_after_step_vs_ref"] = _compare([("output", out2_tp, ref(x))], *tols["out_after_step_vs_ref"])
    res["seconds"] = time.perf_counter() - t0
    return res


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]], tols: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Run every case on this rank (see :func:`run_each`)."""
    return run_each(rank, world_size, cases, lambda case, mesh: _run_case(case, mesh, tols))


def run_each(rank: int, world_size: int, cases: list[dict[str, Any]], run: Any) -> dict[str, Any]:
    """``run(case, mesh)`` for every case on this rank, over a 1-D ``tp`` mesh of the world;
    a case that raises is recorded and ends the run (the ranks agree on that after every
    case, so none waits in a stray collective)."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case["id"]] = run(case, mesh)
        except Exception:
            out[case["id"]] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
        ok: list[Any] = [None] * world_size
        dist.all_gather_object(ok, "error" not in out[case["id"]])
        if not all(ok):
            break
    return out
