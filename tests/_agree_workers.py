"""Spawn-importable workers for ``tests/test_agree.py``: ranks given different plans, or a
planner that fails on one rank. Each returns ``(error type, message, seconds)``; kept apart
from the test module so the children never import pytest."""

from __future__ import annotations

import time

import torch

import shardplan
from shardplan.apply.mesh import make_mesh
from shardplan.models import build_preset


def _timed(fn) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return "", "", time.perf_counter() - start


def different_plans(rank: int, world_size: int, plan_yaml: str) -> tuple[str, str, float]:
    plan = shardplan.Plan.from_yaml(plan_yaml)
    if rank == 1:  # a hand-edited rule on one rank only
        rules = [r.model_copy(update={"style": "replicate"}) if r.style == "rowwise" else r for r in plan.rules]
        plan = plan.model_copy(update={"rules": rules})
    model = build_preset("mlp", device="cpu")
    return _timed(lambda: shardplan.apply_plan(model, make_mesh({"tp": world_size}), plan))


def planner_fails_on_one_rank(rank: int, world_size: int) -> tuple[str, str, float]:
    model = build_preset("mlp", device="cpu")
    budget = "1KB" if rank == 1 else None  # no plan fits 1 KB per device
    inputs = (torch.zeros(2, 128),)
    return _timed(lambda: shardplan.auto_parallelize(model, make_mesh({"tp": world_size}), example_inputs=inputs,
                                                     memory_budget=budget, explain=False))


def plan_under_the_process_group(rank: int, world_size: int) -> str:
    """The plan ``auto_parallelize`` would apply, made on this rank under its gloo group."""
    from tests.portability.heads import HardCodedHeads

    with torch.device("meta"):
        model = torch.nn.Sequential(HardCodedHeads(), torch.nn.LayerNorm(32))
    mesh = make_mesh({"tp": world_size})
    return shardplan.plan_model(model, mesh, example_inputs=(torch.zeros(2, 8, 32, device="meta"),)).to_yaml()


def moe_numerics(rank: int, world_size: int, plan_yaml: str) -> dict[str, float]:
    """torchtitan-layout experts (w1, w2, w3) under the plan vs one process: max |diff| of the
    output and of every gradient."""
    import copy

    from torch.distributed.tensor import DTensor

    from tests.portability.root_param import tiny_moe

    torch.manual_seed(0)
    ref = tiny_moe()
    tp = copy.deepcopy(ref)
    shardplan.apply_plan(tp, make_mesh({"tp": world_size}), shardplan.Plan.from_yaml(plan_yaml))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    out_ref, out_tp = ref(x), tp(x)
    out_ref.square().sum().backward()
    out_tp.square().sum().backward()
    diffs = {"output": float((out_tp - out_ref).abs().max())}
    for (name, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        grad = b.grad.full_tensor() if isinstance(b.grad, DTensor) else b.grad
        diffs[name] = float((grad - a.grad).abs().max())
    diffs["sharded"] = float(isinstance(tp.experts.w3, DTensor) and tp.experts.w3.to_local().shape[1] == 32 // world_size)
    return diffs
