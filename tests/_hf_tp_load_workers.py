"""Spawn-importable worker for ``tests/test_hf_tp_load.py``: transformers' own tensor-parallel
loading (``from_pretrained`` with a ``tp_plan`` dict) on real gloo ranks.

``load_and_run(rank, world_size, folder, tp_plan, input_ids, ways)`` runs on every rank under
``shardplan.tools.launch.run_on_gloo`` (which has already joined the ranks into one gloo default
process group). For each way of passing the plan in ``ways``:

* ``"distributed_config"``: ``from_pretrained(folder, distributed_config=DistributedConfig(
  tp_size=world_size, tp_plan=tp_plan), dtype=torch.float32)``, the documented form;
* ``"tp_plan_kwarg"``: ``from_pretrained(folder, tp_plan=tp_plan, tp_size=world_size,
  dtype=torch.float32)``, the older standalone arguments (deprecated, FutureWarning).

it loads the model, runs ``input_ids`` in eval mode under ``no_grad`` and returns the full
logits, the tensor-parallel plan transformers resolved (``model.tp_plan``: its own
``base_model_tp_plan`` merged with the dict, ``*`` patterns), the mesh it used, and for every
parameter what this rank holds: the local shard (``to_local()`` of a DTensor, else the tensor
itself), the DTensor placements and global shape. Kept apart from the test module so the
children never import pytest.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported, in the spawned child too

import torch
from torch.distributed.tensor import DTensor

WAYS = ("distributed_config", "tp_plan_kwarg")


def _load(folder: str, tp_plan: dict[str, str], world_size: int, way: str):
    from transformers import AutoModelForCausalLM, DistributedConfig

    if way == "distributed_config":
        config = DistributedConfig(tp_size=world_size, tp_plan=dict(tp_plan))
        return AutoModelForCausalLM.from_pretrained(folder, distributed_config=config, dtype=torch.float32)
    if way == "tp_plan_kwarg":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "Passing `tp_plan` directly ... is deprecated"
            return AutoModelForCausalLM.from_pretrained(
                folder, tp_plan=dict(tp_plan), tp_size=world_size, dtype=torch.float32
            )
    raise ValueError(f"unknown way {way!r}; expected one of {WAYS}")


def _param_record(p: torch.Tensor) -> dict[str, Any]:
    if isinstance(p, DTensor):
        return {
            "dtensor": True,
            "placements": [str(pl) for pl in p.placements],
            "shard_dims": [pl.dim for pl in p.placements if pl.is_shard()],
            "global_shape": tuple(p.shape),
            "local": p.to_local().detach().clone(),
        }
    return {"dtensor": False, "placements": [], "shard_dims": [], "global_shape": tuple(p.shape),
            "local": p.detach().clone()}


def load_and_run(
    rank: int, world_size: int, folder: str, tp_plan: dict[str, str], input_ids: torch.Tensor,
    ways: tuple[str, ...] = WAYS,
) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for way in ways:
        t0 = time.perf_counter()
        model = _load(folder, tp_plan, world_size, way)
        load_s = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        logits_was_dtensor = isinstance(logits, DTensor)
        if logits_was_dtensor:
            logits = logits.full_tensor()
        mesh = getattr(model, "_device_mesh", None)
        out[way] = {
            "logits": logits.detach().clone(),
            "logits_was_dtensor": logits_was_dtensor,
            "resolved_tp_plan": dict(model.tp_plan or {}),
            "tp_size": getattr(model, "_tp_size", None),
            "mesh": None if mesh is None else {"shape": tuple(mesh.shape), "names": tuple(mesh.mesh_dim_names or ()),
                                               "device_type": mesh.device_type},
            "params": {n: _param_record(p) for n, p in model.named_parameters()},
            "load_s": load_s,
            "total_s": time.perf_counter() - t0,
        }
        del model
    return out
