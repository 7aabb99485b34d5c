"""Spawn-importable gloo worker for ``tests/test_properties.py``.

``run_cases(rank, world_size, cases)`` runs on every gloo rank (see
``shardplan.tools.launch.run_on_gloo``). Each case is ``{"id", "cfg", "plan_yaml"}``: a
:class:`tests._property_models.PropConfig` as a dict and the plan, planned in the parent
on the meta device, as YAML text. The rank builds a float32 reference model and an
identical copy on CPU (same seed), applies the plan to the copy on a 1-D ``("tp",)``
mesh, runs forward, a cross-entropy loss against fixed targets and backward on both, and
returns per case the worst ``|tp - ref|`` of the output and of every gradient (gathered
with ``full_tensor()``), plus a few structural facts for the parent to assert.

Kept apart from the test module so the spawned children import neither pytest nor it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardplan
from tests._numerics_workers import run_each
from tests._property_models import PropConfig, build, example_ids

_TARGET_SEED = 4321


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if tuple(a.shape) != tuple(b.shape):
        raise AssertionError(f"TP shape {tuple(a.shape)} != reference {tuple(b.shape)}")
    if not torch.isfinite(a).all():
        raise AssertionError("TP result has non-finite values")
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _run_case(case: dict[str, Any], mesh) -> dict[str, Any]:
    cfg = PropConfig(**case["cfg"])
    plan = shardplan.Plan.from_yaml(case["plan_yaml"])
    ref = build(cfg, device="cpu", seed=0)
    tp = build(cfg, device="cpu", seed=0)
    shardplan.apply_plan(tp, mesh, plan)
    ids = example_ids(cfg, batch=2, seq=8, device="cpu", seed=1)
    target = torch.randint(0, cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(_TARGET_SEED))

    out_ref = ref(ids)
    F.cross_entropy(out_ref.flatten(0, -2), target.flatten()).backward()
    out_tp = tp(ids)
    if isinstance(out_tp, DTensor):  # vocab-sharded logits (a loss_parallel plan)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            F.cross_entropy(out_tp.flatten(0, -2), target.flatten()).backward()
    else:
        F.cross_entropy(out_tp.flatten(0, -2), target.flatten()).backward()

    ref_params, tp_params = dict(ref.named_parameters()), dict(tp.named_parameters())
    grads = {}
    for name, p in ref_params.items():
        q = tp_params.get(name)
        if q is None or q.grad is None or p.grad is None:
            grads[name] = None
            continue
        got = _full(q.grad)
        grads[name] = _max_abs(got, p.grad)
    worst = max((k for k in grads if grads[k] is not None), key=lambda k: grads[k], default=None)
    return {
        "out": _max_abs(_full(out_tp), out_ref),
        "out_scale": float(out_ref.abs().max()),
        "grad": grads[worst] if worst else 0.0,
        "grad_worst": worst,
        "missing_grads": sorted(k for k, v in grads.items() if v is None),
        "names_match": sorted(ref_params) == sorted(tp_params),
        "non_dtensor": sorted(n for n, p in tp_params.items() if not isinstance(p, DTensor)),
        "sharded": sorted(n for n, p in tp_params.items() if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)),
        "styles": sorted(set(plan.module_styles().values())),
    }


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case on this rank (``tests._numerics_workers.run_each``)."""
    return run_each(rank, world_size, cases, _run_case)
