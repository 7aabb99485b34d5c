"""Spawn-importable worker for ``tests/test_kv_cache.py``: generation with a KV cache split
by kv heads on gloo ranks against one process, with no gradient (as generation runs).

``decode(rank, world_size, builder, plan_yaml, prefill, steps)`` builds the model twice,
applies the plan to one copy on a ``("tp",)`` mesh, then runs both on the same tokens: a
prefill of ``prefill`` tokens and ``steps`` single-token steps, each at the next position of
the cache. It returns the worst |difference| of the logits at every call, in call order.
``save_cache`` and ``load_cache``: gpt-fast's persistent caches through DCP and full state dicts."""

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


def _gpt_fast(world_size: int, plan_yaml: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model = kv_cache.gpt_fast_cache()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    shardplan.apply_plan(model, mesh, Plan.from_yaml(plan_yaml))
    return model, torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def save_cache(rank: int, world_size: int, plan_yaml: str, folder: str) -> dict:
    """gpt-fast's model after a prefill, its persistent caches split by kv heads: the state
    dict's cache entries (DTensors), saved with DCP, and everything gathered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    model, tokens = _gpt_fast(world_size, plan_yaml)
    with torch.no_grad():
        model(tokens)
    state = model.state_dict()
    dcp.save(state, checkpoint_id=folder)
    split = sorted(k for k, v in state.items() if isinstance(v, DTensor) and k.endswith("_cache"))
    return {"full": shardplan.full_state_dict(model), "split": split}


def load_cache(rank: int, world_size: int, plan_yaml: str, folder: str, full: dict) -> dict:
    """A fresh model (empty caches) loads the checkpoint with DCP, and another the gathered
    state with ``load_full_state_dict``; the first then decodes the next token from its cache."""
    import torch.distributed.checkpoint as dcp

    model, tokens = _gpt_fast(world_size, plan_yaml)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state)
    other, _ = _gpt_fast(world_size, plan_yaml)
    shardplan.load_full_state_dict(other, full)
    loaded = shardplan.full_state_dict(model)
    with torch.no_grad():  # (it writes the new token's keys into the cache)
        logits = model.model(tokens[:, :1], torch.tensor([16]))
    return {"dcp": loaded, "from_full": shardplan.full_state_dict(other), "logits": logits}
