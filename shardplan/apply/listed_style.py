"""Listed-heads style: a list of head modules split whole over tp, their projection rowwise.

Contract
--------
``ListedHeadsParallel`` (``listed_heads`` in a plan) is the ``ParallelStyle`` of a module
written as a list of alike heads and one projection of their outputs side by side
(:func:`shardplan.analyze.trace.listed_heads`; :mod:`shardplan.decide.listed` checked its
call and has the matrix math). On tp rank r:

* heads ``[r n/tp, (r + 1) n/tp)`` stay as they are: plain parameters, run whole by the
  module's own code on the whole input, so no size in their code changes;
* every other head becomes a :class:`RemoteHead`, with no parameters: its state-dict keys
  are held by its owner (``full_state_dict``, ``load_full_state_dict``, DCP and ``verify``
  see each head once, as for experts listed over ep); its call returns the input's leading
  dims with no features, so the module's ``torch.cat`` gives exactly this rank's columns of
  the concatenation (``Shard(-1)`` of it);
* the projection is torch's ``RowwiseParallel`` reading those columns: its partial sums are
  all-reduced (or reduce-scattered onto sequence shards, ``output_layouts``);
* each floating input enters whole (gathered from sequence shards when ``input_layouts``
  says so) and leaves backward as a Partial gradient summed across ranks, Megatron's *f*:
  each rank back-propagated only its heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map_only

from ..analyze.trace import listed_heads
from .attention_style import _whole_with_partial_grad
from .experts_listed import Owners, RemoteExpert

__all__ = ["ListedHeadsParallel", "RemoteHead"]


class RemoteHead(RemoteExpert):
    """A head another tp rank holds: no parameters here; its call hands the module's
    concatenation no features (the input's leading dims, last dim 0)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x.new_zeros(x.shape[:-1] + (0,))

    def extra_repr(self) -> str:
        return f"owner=tp rank {self.owner}"


class ListedHeadsParallel(ParallelStyle):
    """``input_layouts``: how the first input arrives (Replicate, or Shard(seq) gathered on
    entry); ``output_layouts``: what the projection's partial sums become (Replicate or
    Shard(seq))."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = listed_heads(module)
        if names is None:
            raise ValueError(f"listed_heads needs a module holding one nn.ModuleList of alike head modules and one "
                             f"projection Linear; got {type(module).__name__}; use replicate for it")
        heads, tp, rank = module.get_submodule(names[0]), device_mesh.size(), device_mesh.get_local_rank()
        if len(heads) % tp:
            raise ValueError(f"{type(module).__name__}.{names[0]} has {len(heads)} heads, which tp={tp} does not "
                             f"divide; use a tp that divides {len(heads)}, or replicate for it")
        local = len(heads) // tp
        for position, key in enumerate(list(heads._modules)):
            if position // local != rank:
                heads._modules[key] = RemoteHead(position // local, heads._modules[key])
        heads._shardplan_owners = Owners(device_mesh.get_group(), local)
        parallelize_module(module.get_submodule(names[1]), device_mesh,
                           RowwiseParallel(input_layouts=Shard(-1), output_layouts=self.output_layouts))
        module.register_forward_pre_hook(self._enter(device_mesh), with_kwargs=True)
        return module

    def _enter(self, mesh: Any) -> Any:
        def enter(_module, args, kwargs):
            seen: dict[int, torch.Tensor] = {}

            def whole(x: torch.Tensor) -> torch.Tensor:
                if not x.is_floating_point():
                    return x
                if id(x) not in seen:  # a tensor passed twice is summed once
                    layout = Replicate() if seen else self.input_layouts
                    seen[id(x)] = _whole_local(x, mesh, layout)
                return seen[id(x)]

            return tree_map_only(torch.Tensor, whole, (args, kwargs))
        return enter


def _whole_local(x: torch.Tensor, mesh: Any, layout: Placement) -> torch.Tensor:
    """``x`` whole on this rank, its gradient this rank's heads' share, summed on the way back;
    a DTensor a region handed in is gathered the same way."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
    return _whole_with_partial_grad(x, mesh, layout)
