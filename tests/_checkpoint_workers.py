"""Spawn-importable workers for ``tests/test_checkpoint.py`` (no pytest here).

``train_and_save`` (tp=a ranks): build a tiny model from a seed, apply the plan, take one
AdamW step, save model and optimizer state with DCP, and return the gathered state.
``load_and_report`` (tp=b ranks): build the same model from another seed, apply the tp=b
plan, load the DCP checkpoint (model and optimizer) and, separately, a full state dict, and
return what each load produced. Every rank returns the same gathered tensors; the parent
compares rank 0's against an unsharded load of the same checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import shardplan
from shardplan.interop.hf import build_hf_model

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(model_type: str, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny model with weights from ``seed``, and token ids that do not depend on it."""
    model, inputs, _ = build_hf_model(model_type, tiny=True, device="cpu", seed=seed)
    ids = torch.randint(0, model.config.vocab_size, tuple(inputs[0].shape), generator=torch.Generator().manual_seed(7))
    return model, ids


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), ids.roll(-1, dims=1).flatten())


def one_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, ids).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _sharded(model_type: str, seed: int, world_size: int, plan_yaml: str):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model, ids = build(model_type, seed)
    shardplan.apply_plan(model, mesh, shardplan.Plan.from_yaml(plan_yaml))
    return model, ids


def train_and_save(rank: int, world_size: int, model_type: str, plan_yaml: str, folder: str) -> dict[str, Any]:
    model, ids = _sharded(model_type, 0, world_size, plan_yaml)
    opt = one_step(model, ids)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
    with torch.no_grad():
        logits = model(ids).logits
    return {"model": shardplan.full_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FULL),
            "dcp_full_model": get_model_state_dict(model, options=FULL), "logits": logits}


def load_and_report(rank: int, world_size: int, model_type: str, plan_yaml: str, folder: str,
                    full: dict[str, torch.Tensor]) -> dict[str, Any]:
    model, ids = _sharded(model_type, 1, world_size, plan_yaml)  # another seed: every tensor must come from the file
    opt = one_step(model, ids)  # the optimizer has state to overwrite
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    with torch.no_grad():
        logits = model(ids).logits
    out = {"model": shardplan.full_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FULL),
           "logits": logits}
    other, _ = _sharded(model_type, 2, world_size, plan_yaml)
    shardplan.load_full_state_dict(other, full)
    out["from_full"] = shardplan.full_state_dict(other)
    with torch.no_grad():
        out["from_full_logits"] = other(ids).logits
    return out
