"""DTensor-weights style: a module whose own code reads its weights as tensors, run on DTensors.

Contract
--------
``DTensorWeights`` (``dtensor_weights`` in a plan) is a ``ParallelStyle`` for a module that
owns its weights and reads them in its own forward (``F.linear(x, self.wq)``, ``x @ self.w1``,
``einsum(..., self.kernel)``), as :mod:`shardplan.decide.functional` found them. Each own
parameter becomes a DTensor placed as the plan's ``param_layouts`` say (the rest
Replicate); the module keeps its class, parameter names and signature, so state dicts and
DCP see the unsharded module.

For the module's call only, the code runs in DTensor's global view, torchtitan's full-DTensor
way: its sizes (``view(B, T, self.n_heads, -1)``) are the global ones it was written for, and
DTensor's sharding propagation carries the split through views, RoPE and attention.

* the tensor inputs enter as Replicate DTensors (sequence shards, ``Shard(1)``, are
  all-gathered first; a first input split on a later dim, the heads a previous module made,
  enters as that Shard and is contracted there):
  rank r's first products ``x W_r`` give its own heads with no collective; in backward an
  input's gradient that arrives Partial (each rank back-propagated its heads) is all-reduced
  (reduce-scattered for a gathered input) once, when it leaves ``from_local``, or by the
  region that handed it in as a DTensor; any other collective the code needs (an all-reduce
  before a residual) is DTensor's own, as the planner counted it;
* any plain tensor the code meets beside a DTensor (a causal mask made in forward, a RoPE
  buffer) is taken as Replicate where it is read, and attention on heads split alike runs on
  each rank's heads (:class:`~shardplan.decide.dtensor_run.ReplicateBeside`, the same rules
  the planner ran the code by);
* a whole parameter whose gradient backward leaves Partial (the rule's ``partial_grads``: a
  per-head norm's weight beside split heads) is summed with the other Partial gradients in
  one all-reduce when backward ends (:mod:`.gradsync`);
* the output leaves as the plan says: a Partial sum (second products ``y_r W_r``) is
  all-reduced, or reduce-scattered onto sequence shards; a Shard(d) output (a DenseGeneral's
  heads) is handed on as the rank's local shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map, tree_map_only

from ..decide.dtensor_run import ReplicateBeside

__all__ = ["DTensorWeights"]


class DTensorWeights(ParallelStyle):
    """``placements``: each own parameter's placement by name (absent: Replicate);
    ``input_layouts``: how the first input arrives (Replicate, or Shard(seq) gathered on
    entry); ``output_layouts``: what a Partial output becomes (Replicate or Shard(seq))."""

    def __init__(self, *, placements: dict[str, Placement], input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None) -> None:
        super().__init__()
        self.placements = placements
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._distribute(module, device_mesh)
        self._hooks(module, device_mesh)
        return module

    def _distribute(self, module: nn.Module, device_mesh) -> None:
        for name, p in list(module.named_parameters()):  # its norm children's too: they run inside its code
            if not isinstance(p, DTensor):
                dist = distribute_tensor(p.detach(), device_mesh, [self.placements.get(name, Replicate())],
                                         src_data_rank=self.src_data_rank)
                prefix, _, leaf = name.rpartition(".")
                (module.get_submodule(prefix) if prefix else module).register_parameter(
                    leaf, nn.Parameter(dist, requires_grad=p.requires_grad))

    def _hooks(self, module: nn.Module, device_mesh) -> None:
        modes: list[tuple[ReplicateBeside, bool]] = []

        def enter(_module, args, kwargs):
            seen = []

            def whole(x: torch.Tensor) -> torch.Tensor:
                layout = Replicate() if seen else self.input_layouts  # the first input may come split
                seen.append(x)
                d = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (layout,), run_check=False)
                # sequence shards are gathered here; a split on a later dim (a previous module's
                # heads) stays, for the products that contract it
                return d.redistribute(device_mesh, (Replicate(),)) if layout == Shard(1) else d

            args, kwargs = tree_map_only(torch.Tensor, whole, (args, kwargs))
            # tensors made below the torch function level (a causal mask inside attention's math
            # kernel) are taken as Replicate too, as implicit_replication() does
            modes.append((ReplicateBeside(device_mesh), DTensor._op_dispatcher._allow_implicit_replication))
            DTensor._op_dispatcher._allow_implicit_replication = True
            modes[-1][0].__enter__()
            return args, kwargs

        def leave(_module, _args, _kwargs, output):
            mode, implicit = modes.pop()
            mode.__exit__(None, None, None)
            DTensor._op_dispatcher._allow_implicit_replication = implicit
            return tree_map(self._local, output)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)

    def _local(self, out: Any) -> Any:
        if not isinstance(out, DTensor):
            return out
        if out.placements[0].is_partial():
            out = out.redistribute(out.device_mesh, (self.output_layouts,))
        return out.to_local()
