"""Spawn-importable worker for ``tests/test_hf.py``: tiny Hugging Face models on real gloo ranks.

``run_cases(rank, world_size, cases, tols)`` runs on every rank (``shardplan.tools.launch.run_on_gloo``).
For each case (``{"id", "model_type", "plan_yaml"}``) it rebuilds the plan from YAML, builds
the tiny float32 model twice from the same seed (``shardplan.interop.hf.build_hf_model(..., tiny=True,
device="cpu", seed=0)``: a reference and a copy, checked identical), applies the plan to the
copy on a 1-D ``("tp",)`` mesh, runs forward, a scalar loss and backward on both in eval mode
(dropout off) and returns the worst differences per category (``out``, ``loss``, ``grad``)
plus structural checks, and whether one ``AdamW(foreach=True)`` step runs on the TP model. Kept apart from the test module so the children never import pytest.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported, in the spawned child too

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from tests._checks import parameter_checks
from shardplan.interop.hf import build_hf_model

CATEGORIES = ("out", "loss", "grad")
_TARGET_SEED = 4321


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _main_output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0] if isinstance(out, (tuple, list)) else out


def _loss(out: torch.Tensor, is_lm: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_TARGET_SEED)
    if is_lm:
        target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen)
        return F.cross_entropy(out.flatten(0, -2), target.flatten())
    return F.mse_loss(out, torch.randn(out.shape, generator=gen, dtype=out.dtype))


def _compare(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], atol: float, rtol: float) -> dict[str, Any]:
    """Worst |tp - ref| over ``pairs``; ``ratio`` <= 1: every element within atol + rtol * |ref|."""
    per: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for name, got, want in pairs:
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{name}: TP shape {tuple(got.shape)} != reference {tuple(want.shape)}")
        if not torch.isfinite(got).all():
            raise AssertionError(f"{name}: TP result has non-finite values")
        d = (got.detach().double() - want.detach().double()).abs()
        per[name] = float(d.max()) if d.numel() else 0.0
        ratios[name] = float((d / (atol + rtol * want.detach().double().abs())).max()) if d.numel() else 0.0
    worst = max(per, key=per.get)
    worst_ratio = max(ratios, key=ratios.get)
    return {
        "max_abs": per[worst], "worst": worst, "ratio": ratios[worst_ratio], "ratio_worst": worst_ratio,
        "top": sorted(per.items(), key=lambda kv: -kv[1])[:3], "count": len(per),
    }



def _run_case(case: dict[str, Any], mesh, tols: dict[str, tuple[float, float]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    plan = shardplan.Plan.from_yaml(case["plan_yaml"])
    ref, inputs, kwargs = build_hf_model(case["model_type"], tiny=True, device="cpu", seed=0)
    tp, inputs2, kwargs2 = build_hf_model(case["model_type"], tiny=True, device="cpu", seed=0)
    for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        if a.dtype != torch.float32 or not torch.equal(a, b):
            raise AssertionError(f"{n}: the two seeded builds differ before apply_plan")
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs2)), "seeded example inputs differ"
    ref.eval()
    tp.eval()
    shardplan.apply_plan(tp, mesh, plan)

    checks: dict[str, Any] = parameter_checks(ref, tp)
    ref_params = dict(ref.named_parameters())
    tp_params = dict(tp.named_parameters())

    out_ref = _main_output(ref(*inputs, **kwargs))
    out_tp = _full(_main_output(tp(*inputs, **kwargs)))
    is_lm = hasattr(ref, "get_output_embeddings") and ref.get_output_embeddings() is not None \
        and out_ref.shape[-1] == ref.config.get_text_config().vocab_size
    loss_ref = _loss(out_ref, is_lm)
    loss_tp = _loss(out_tp, is_lm)
    loss_ref.backward()
    loss_tp.backward()

    res: dict[str, Any] = {"checks": checks}
    res["out"] = _compare([("output", out_tp, out_ref)], *tols["out"])
    res["loss"] = _compare([("loss", loss_tp, loss_ref)], *tols["loss"])
    res["loss"]["value"] = loss_ref.item()
    # a parameter the reference leaves without a gradient (unused in this forward) is not compared
    checks["missing_grads"] = sorted(
        n for n, p in tp_params.items() if p.grad is None and ref_params[n].grad is not None
    ) if checks["names_match"] else []
    checks["extra_grads"] = sorted(
        n for n, p in tp_params.items() if p.grad is not None and n in ref_params and ref_params[n].grad is None
    )
    checks["partial_grads"] = sorted(
        n for n, p in tp_params.items()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )
    common = [n for n in ref_params if n in tp_params and tp_params[n].grad is not None and ref_params[n].grad is not None]
    checks["num_grads"] = len(common)
    res["grad"] = _compare(
        [(n, _full(tp_params[n].grad), ref_params[n].grad) for n in common], *tols["grad"]
    )
    # the TP model must train with a stock foreach optimizer (it cannot mix DTensor and plain tensors)
    try:
        torch.optim.AdamW(tp.parameters(), lr=1e-2, foreach=True).step()
        checks["adamw_foreach_error"] = ""
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        checks["adamw_foreach_error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["seconds"] = time.perf_counter() - t0
    return res


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]], tols: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Run every case on this rank. A case that raises is recorded; the ranks then agree
    (one all_gather_object per case) and go on only if every rank failed alike, since a
    one-sided failure may have left the other rank's collectives unmatched."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case["id"]] = _run_case(case, mesh, tols)
        except Exception:  # noqa: BLE001 - reported to the parent
            out[case["id"]] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
        ok: list[Any] = [None] * world_size
        dist.all_gather_object(ok, "error" not in out[case["id"]])
        if len(set(ok)) > 1:
            break
    return out
