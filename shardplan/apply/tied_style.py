"""Tied reads: code outside a weight module that reads its split weight, run on DTensors.

Contract
--------
``tied_reads(model, paths, mesh)`` makes the parameters ``paths`` (each a sharded weight of a
module, say a vocab-parallel embedding's ``Shard(0)`` table) usable where other code reads
them as tensors, torchtune's ``TiedLinear`` (``F.linear(h, self.tied_module.weight)``) or a
research GPT's ``x @ self.wte.weight.T``, as :mod:`shardplan.decide.tied` planned it.

While ``model`` runs forward, outside the forward of the modules that own the parameters
(whose own styles run them):

* an op whose tensor arguments are all tied values (the parameter, ``W.t()``, a cast) keeps
  its DTensor result, tied too;
* an op reading a tied value beside activations (the head's product) takes each plain
  activation as Replicate: with W ``Shard(0)``, rank r computes ``h W_r^T``, its vocabulary's
  logits (``Shard(-1)``), with no collective; in backward ``dh = sum_r dY_r W_r`` arrives
  Partial and is all-reduced once, where ``from_local`` hands it back. The logits are then
  all-gathered (``full_tensor``), so the code after the read (a loss, a softcap) meets whole
  plain tensors, as the plan priced it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["tied_reads"]


class _TiedReads(TorchFunctionMode):
    def __init__(self, model: nn.Module, paths: list[str], mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.owners = [(model.get_submodule(p.rpartition(".")[0]), p.rpartition(".")[2]) for p in paths]
        self.derived: dict[int, weakref.ref] = {}  # id -> the tied DTensor an op made of tied values
        self.inside = 0  # > 0 while an owning module's own forward runs

    def _tied(self, flat: list[Any]) -> list[bool]:
        # looked up on each call: FSDP swaps a parameter for its unsharded copy around forward
        params = {id(owner._parameters.get(name)) for owner, name in self.owners}
        return [isinstance(a, DTensor) and (id(a) in params or self._derived(a)) for a in flat]

    def _derived(self, a: DTensor) -> bool:
        ref = self.derived.get(id(a))
        return ref is not None and ref() is a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside:
            return func(*args, **kwargs)
        flat = tree_flatten((args, kwargs))[0]
        tied = self._tied(flat)
        if not any(tied):
            return func(*args, **kwargs)
        if all(t for t, a in zip(tied, flat) if isinstance(a, torch.Tensor)):
            out = func(*args, **kwargs)
            if isinstance(out, DTensor):
                self.derived[id(out)] = weakref.ref(out)
            return out
        whole = {id(a) for t, a in zip(tied, flat) if t}
        args, kwargs = tree_map_only(torch.Tensor, lambda a: a if id(a) in whole else self._replicate(a), (args, kwargs))
        out = func(*args, **kwargs)
        return tree_map_only(DTensor, lambda d: d.full_tensor(), out)

    def _replicate(self, a: torch.Tensor) -> DTensor:
        if isinstance(a, DTensor):
            return a.redistribute(self.mesh, (Replicate(),))
        return DTensor.from_local(a, self.mesh, (Replicate(),), run_check=False)


def tied_reads(model: nn.Module, paths: list[str], mesh) -> None:
    """Install the tied reads of ``paths`` on ``model``'s forward (see the module docstring)."""
    mode = _TiedReads(model, paths, mesh)
    active: list[bool] = []

    def enter(_module, _args):
        active.append(True)
        mode.__enter__()

    def leave(_module, _args, _output):
        if active:
            active.pop()
            mode.__exit__(None, None, None)
            mode.derived.clear()

    def owner_in(_module, _args):
        mode.inside += 1

    def owner_out(_module, _args, _output):
        mode.inside -= 1

    for owner in {p.rpartition(".")[0] for p in paths}:
        module = model.get_submodule(owner)
        module.register_forward_pre_hook(owner_in)
        module.register_forward_hook(owner_out, always_call=True)
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
