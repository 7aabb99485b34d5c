"""Spawn-importable workers for ``tests/test_raw_weights.py`` and ``tests/test_listed_heads.py`` (no pytest here).

``train_and_save`` (tp ranks): a model of :mod:`tests.portability` from seed 0, sharded by the plan and
whole, two AdamW steps each on the same batch; returns both full state dicts after the
steps and saves the sharded model with DCP. ``load_and_report`` (another tp): a model from
another seed, sharded, loads that checkpoint; returns its full state dict and logits.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import shardplan
from tests.portability import raw_weights

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))


def _model(builder: str, seed: int) -> torch.nn.Module:
    """``builder``: a name in :mod:`tests.portability.raw_weights`, or ``module:name``."""
    module, _, name = builder.rpartition(":")
    torch.manual_seed(seed)
    return getattr(importlib.import_module(module) if module else raw_weights, name)()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    out = model(TOKENS)
    return out[0] if isinstance(out, tuple) else out  # (logits, loss) when no targets are given


def _steps(model: torch.nn.Module, n: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(n):
        logits = _logits(model)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2), TOKENS.roll(-1, dims=1).flatten()).backward()
        opt.step()
        opt.zero_grad()


def _sharded(builder: str, seed: int, world_size: int, plan_yaml: str) -> torch.nn.Module:
    model = _model(builder, seed)
    shardplan.apply_plan(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
                         shardplan.Plan.from_yaml(plan_yaml))
    return model


def train_and_save(rank: int, world_size: int, builder: str, plan_yaml: str, folder: str) -> dict[str, Any]:
    model, whole = _sharded(builder, 0, world_size, plan_yaml), _model(builder, 0)
    _steps(model)
    _steps(whole)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    return {"sharded": shardplan.full_state_dict(model), "whole": {k: v.detach().clone() for k, v in whole.state_dict().items()}}


def load_and_report(rank: int, world_size: int, builder: str, plan_yaml: str, folder: str) -> dict[str, Any]:
    model = _sharded(builder, 1, world_size, plan_yaml)  # another seed: every tensor must come from the file
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    with torch.no_grad():
        logits = _logits(model)
    return {"model": shardplan.full_state_dict(model), "logits": logits}


def load_safetensors(rank: int, world_size: int, builder: str, plan_yaml: str, path: str) -> dict[str, Any]:
    """A model from another seed, sharded, reads the unsharded safetensors file at ``path``
    (``load_checkpoint``: each rank its own slices and heads); returns its full state dict."""
    model = _sharded(builder, 1, world_size, plan_yaml)
    shardplan.load_checkpoint(model, path)
    return {"model": shardplan.full_state_dict(model)}
