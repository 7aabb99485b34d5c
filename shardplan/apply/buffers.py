"""Written buffers: each rank's chunk of a tensor the forward writes split activations into.

Contract
--------
``set_local_buffers(model, plan, rank=..., mesh=...)`` replaces each tensor a plan's
``buffers`` entry names (a KV cache, ``Shard(2)`` by kv heads, or by kv heads in groups) by
this rank's chunk, a plain tensor as before: the module's code, on local tensors, writes and
reads its shard as it did the whole one.

A persistent buffer (gpt-fast's ``register_buffer('k_cache', ...)``) is in the state dict,
so its entry must stay the global tensor: with a ``mesh`` it gets two hooks. The state-dict
hook presents the rank's chunk as ``DTensor.from_local(chunk, mesh, [Shard(d)])`` (what DCP
saves and loads under any tp, and ``full_state_dict`` gathers), sharing the chunk's memory
so that DCP's in-place load fills the buffer itself. The load pre-hook turns what is loaded
back into the rank's chunk: a DTensor (``to_local`` where placed alike, else its rank's slice
of ``full_tensor``), or a plain global tensor, cut here. A buffer in kv-head groups has no
one-DTensor spelling, so the planner never puts a persistent buffer in groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..plan.model import Plan, expand_pattern, persistent_buffer
from .styles import placement

__all__ = ["set_local_buffers"]


def set_local_buffers(model: nn.Module, plan: Plan, *, rank: int, mesh: Any = None) -> None:
    """Each split tensor becomes the rank's chunk; a persistent one is also hooked into the
    state dict when ``mesh`` (the tp mesh) is given."""
    for entry in plan.buffers:
        for fqn in expand_pattern(entry.module, plan.model.repeats):
            module = model.get_submodule(fqn)
            for name, layout in entry.layouts.items():
                dim = placement(layout).dim
                # n kv heads in groups: rank r holds head r // (tp / n), which its query heads read
                n = entry.groups.get(name, plan.tp)
                local = getattr(module, name).chunk(n, dim=dim)[rank // (plan.tp // n)].contiguous()
                if name in module._buffers:
                    module._buffers[name] = local
                else:
                    setattr(module, name, local)
                if mesh is not None and persistent_buffer(module, name):
                    _hook_state(module, name, mesh, dim)


def _hook_state(module: nn.Module, name: str, mesh: Any, dim: int) -> None:
    def present(mod: nn.Module, state: dict, prefix: str, _meta: Any) -> None:
        key = prefix + name
        if key in state and not isinstance(state[key], DTensor):
            state[key] = DTensor.from_local(state[key], mesh, [Shard(dim)], run_check=False)

    def take(mod: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        key = prefix + name
        if key in state:
            state[key] = _rank_chunk(state[key], mesh, dim, like=mod._buffers[name])

    module.register_state_dict_post_hook(present)
    module._register_load_state_dict_pre_hook(take, with_module=True)


def _rank_chunk(value: torch.Tensor, mesh: Any, dim: int, *, like: torch.Tensor) -> torch.Tensor:
    """The rank's ``Shard(dim)`` chunk of a loaded value, whatever form it came in."""
    if isinstance(value, DTensor):
        if tuple(value.placements) == (Shard(dim),) and value.device_mesh == mesh:
            return value.to_local()
        value = value.full_tensor()
    if value.shape[dim] != like.shape[dim] * mesh.size():
        return value  # not the global tensor (a rank's own chunk): load_state_dict judges its shape
    return value.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
