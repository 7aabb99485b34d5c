"""Spawn-importable workers for ``tests/test_load.py`` (no pytest here).

``materialize_and_load`` (tp ranks): build the tiny model on the meta device, apply the
plan, ``shardplan.materialize(seed=0)``, run a forward and backward, then
``shardplan.load_checkpoint`` each checkpoint folder in turn (the shards are reset to NaN
before each, so every load has to write every element), counting the bytes each rank asks
``safetensors`` for, per key. Then (``other_inits``) ``init=`` a function of the whole model,
and an unseeded ``materialize`` on ranks whose generators differ. Every rank returns the
gathered tensors and its own counts.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import safetensors
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.interop.hf import build_hf_model


def build(model_type: str, device: str, seed: int | None = None) -> torch.nn.Module:
    """The tiny model: a shardplan preset (``llama3-debug``) or a Hugging Face type;
    ``llama-tied`` is HF Llama with ``tie_word_embeddings`` (no lm_head in the file)."""
    from shardplan.interop.hf_models import hf_config, transformers_module
    from shardplan.models.presets import PRESETS, build_preset

    if model_type in PRESETS:
        return build_preset(model_type, device=device, seed=seed or 0)
    config = None
    if model_type == "llama-tied":
        config = hf_config(transformers_module(), "llama", None)
        config.tie_word_embeddings = True
    return build_hf_model(model_type.removesuffix("-tied"), tiny=True, device=device, seed=seed, config=config)[0]


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model, ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), ids.roll(-1, dims=1).flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class _Slice:
    def __init__(self, inner: Any, key: str, counts: dict[str, int]) -> None:
        self.inner, self.key, self.counts = inner, key, counts

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = self.inner[index]
        self.counts[self.key] = self.counts.get(self.key, 0) + out.numel() * out.element_size()
        return out


class _File:
    """``safe_open`` that counts what is read through ``get_slice`` and offers no other
    way to read (a whole-tensor ``get_tensor`` would be an AttributeError)."""

    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self.inner, self.counts = inner, counts

    def __enter__(self) -> "_File":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.inner.get_slice(key), key, self.counts)


@contextmanager
def counting(counts: dict[str, int]):
    original = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _File(original(*a, **k), counts)
    try:
        yield
    finally:
        safetensors.safe_open = original


def materialize_and_load(rank: int, world_size: int, model_type: str, plan_yaml: str, folders: dict[str, str],
                         ids: torch.Tensor) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = build(model_type, "meta")
    shardplan.apply_plan(model, mesh, shardplan.Plan.from_yaml(plan_yaml))
    shardplan.materialize(model, seed=0)
    out: dict[str, Any] = {"init": shardplan.full_state_dict(model)}
    loss = loss_of(model, ids)
    loss.backward()
    out["loss"] = loss.detach()
    out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    out["local_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    out["is_sharded"] = {k: isinstance(v, DTensor) and not all(p.is_replicate() for p in v.placements)
                      for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    for tag, folder in folders.items():
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(math.nan)
        counts: dict[str, int] = {}
        with counting(counts):
            shardplan.load_checkpoint(model, folder)
        with torch.no_grad():
            logits = logits_of(model, ids)
        out[tag] = {"state": shardplan.full_state_dict(model), "logits": logits, "read": counts}
    return {**out, **other_inits(rank, world_size, model_type, plan_yaml)}


def trunc_normal_all(model: torch.nn.Module) -> None:
    """A user's ``init=``: touches every parameter directly (not through its module), and
    rebuilds the preset's RoPE tables (Hugging Face's are rebuilt by materialize itself)."""
    for p in model.parameters():
        torch.nn.init.trunc_normal_(p, std=0.02)
    if hasattr(model, "reset_rope"):
        model.reset_rope()


def other_inits(rank: int, world_size: int, model_type: str, plan_yaml: str) -> dict[str, Any]:
    """``init=`` a function of the whole model, and ranks whose generators differ."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    plan = shardplan.Plan.from_yaml(plan_yaml)
    model = shardplan.apply_plan(build(model_type, "meta"), mesh, plan)
    shardplan.materialize(model, seed=5, init=trunc_normal_all)
    out: dict[str, Any] = {"trunc_normal": shardplan.full_state_dict(model)}
    other = shardplan.apply_plan(build(model_type, "meta"), mesh, plan)
    torch.manual_seed(rank)
    try:
        shardplan.materialize(other)
        out["unseeded"] = "no error"
    except ValueError as exc:
        out["unseeded"] = str(exc)
    return out
