"""Spawn-importable worker for ``tests/test_fsdp.py``.

``train(rank, world_size, plan_yaml, ...)`` runs on every gloo rank of a ``(dp, tp)`` mesh:
it builds ``llama3-debug`` (or ``builder``, a ``module:callable`` token model) twice from one seed, shards one with ``apply_plan`` then
``fully_shard_plan``, and trains both for a few AdamW steps with ``clip_grad_norm_``: the
reference on the whole global batch, the sharded one on its dp rank's slice of it. It returns
the losses (the sharded one averaged over dp), the gradient norms and the worst final weight
differences, so the parent can assert. Imports no pytest.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.apply.fsdp import fully_shard_plan
from shardplan.models.presets import build_preset, get_preset

NAME = "llama3-debug"
LR = 1e-2
_TARGET_SEED = 4321


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor,
          max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, -2), target.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    opt.step()
    opt.zero_grad()
    return loss.detach(), _full(norm).detach()


def _build(builder: str) -> torch.nn.Module:
    if ":" not in builder:
        return build_preset(builder, device="cpu", seed=0)
    module, _, name = builder.partition(":")
    return getattr(importlib.import_module(module), name)()


def _tokens(builder: str, model: torch.nn.Module, batch: int) -> tuple[torch.Tensor, int]:
    """The inputs and the vocabulary (targets are drawn below it)."""
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    if ":" not in builder:
        return get_preset(builder).example_inputs(batch_size=batch, device="cpu")[0], vocab
    return torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(1)), vocab


def train(rank: int, world_size: int, plan_yaml: str, axes: dict[str, int], global_batch: int, steps: int,
          max_norm: float, atol: float, rtol: float, builder: str = NAME) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    plan = shardplan.Plan.from_yaml(plan_yaml)
    ref, model = _build(builder), _build(builder)
    shardplan.apply_plan(model, mesh, plan)
    fully_shard_plan(model, mesh, plan)
    x, vocab = _tokens(builder, ref, global_batch)
    target = torch.randint(0, vocab, x.shape, generator=torch.Generator().manual_seed(_TARGET_SEED))
    dp_mesh = mesh["dp"]
    local = global_batch // dp_mesh.size()
    mine = slice(dp_mesh.get_local_rank() * local, (dp_mesh.get_local_rank() + 1) * local)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, foreach=True) for m in (ref, model)]
    out: dict[str, Any] = {"losses": [], "norms": []}
    for _ in range(steps):
        loss_ref, norm_ref = _step(ref, opts[0], x, target, max_norm)
        loss, norm = _step(model, opts[1], x[mine], target[mine], max_norm)
        dist.all_reduce(loss, group=dp_mesh.get_group())  # each dp rank's mean over its equal slice
        out["losses"].append((float(loss_ref), float(loss / dp_mesh.size())))
        out["norms"].append((float(norm_ref), float(norm)))
    out.update(_weights(ref, model, atol, rtol, builder))
    return out


def _weights(ref: torch.nn.Module, model: torch.nn.Module, atol: float, rtol: float, builder: str) -> dict[str, Any]:
    """Worst |sharded - reference| over the final weights, and its ratio to the tolerance."""
    worst, ratio, placements = ("", 0.0), ("", 0.0), set()
    with torch.no_grad():
        for (name, want), (other, got) in zip(ref.named_parameters(), model.named_parameters()):
            if name != other:
                raise AssertionError(f"parameter order differs: {name} vs {other}")
            placements.add((got.device_mesh.ndim, getattr(got.placements[0], "dim", None) == 0))  # Shard(0) or _StridedShard(0)
            d = (_full(got).double() - want.double()).abs()
            r = float((d / (atol + rtol * want.double().abs())).max())
            worst = max(worst, (name, float(d.max())), key=lambda kv: kv[1])
            ratio = max(ratio, (name, r), key=lambda kv: kv[1])
            moved = not torch.equal(want, build_param(name, builder))
            if not moved:
                raise AssertionError(f"{name} did not move: the steps compared initial values")
    return {"worst_param": worst, "worst_ratio": ratio, "placements": sorted(placements)}


_INITIAL: dict[str, dict[str, torch.Tensor]] = {}


def build_param(name: str, builder: str = NAME) -> torch.Tensor:
    if builder not in _INITIAL:
        _INITIAL[builder] = {n: p.detach() for n, p in _build(builder).named_parameters()}
    return _INITIAL[builder][name]
