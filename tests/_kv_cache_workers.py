"""Spawn-importable worker for ``tests/test_kv_cache.py``: generation with a KV cache split
by kv heads on gloo ranks against one process, with no gradient (as generation runs).

``decode(rank, world_size, builder, plan_yaml, prefill, steps)`` builds the model twice,
applies the plan to one copy on a ``("tp",)`` mesh, then runs both on the same tokens: a
prefill of ``prefill`` tokens and ``steps`` single-token steps, each at the next position of
the cache. It returns the worst |difference| of the logits at every call, in call order."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import shardplan
from shardplan.plan.model import Plan
from tests.portability import kv_cache


def decode(rank: int, world_size: int, builder: str, plan_yaml: str, prefill: int, steps: int) -> list[float]:
    reference = getattr(kv_cache, builder)()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    shardplan.apply_plan(model, mesh, Plan.from_yaml(plan_yaml))
    tokens = torch.randint(0, 256, (2, prefill + steps), generator=torch.Generator().manual_seed(7))
    worst = []
    with torch.no_grad():
        calls = [(tokens[:, :prefill], 0)] + [(tokens[:, p:p + 1], p) for p in range(prefill, prefill + steps)]
        for chunk, start in calls:
            want, got = reference(chunk, start), model(chunk, start)
            worst.append(float((got - want).abs().max()))
    return worst


def prefill(rank: int, world_size: int, builder: str, plan_yaml: str, length: int) -> float:
    """One call of ``length`` tokens (a model whose forward takes tokens alone): the worst
    |difference| of the logits."""
    reference = getattr(kv_cache, builder)()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    shardplan.apply_plan(model, mesh, Plan.from_yaml(plan_yaml))
    tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float((model(tokens) - reference(tokens)).abs().max())
