"""Gradsync: a sequence-parallel norm's Partial gradients, reduced once per optimizer step.

Contract
--------
A norm applied with style ``sequence_parallel`` (or a qk-norm with
``replicated_with_grad_allreduce``) sees 1/tp of the tokens, so the gradient of its
``Replicate`` weight is ``Partial``: each tp rank holds the sum over its own tokens.
``install_gradient_sync(model, names)`` (called by :func:`.emit.shard`) leaves those
gradients ``Partial`` through backward and, at the end of every backward, turns all of
them to ``Replicate`` with **one** all-reduce over the tp group: the local tensors are
flattened into one buffer per (mesh, dtype), summed, and written back in place.

* ``set_requires_gradient_sync(model, False)`` skips that reduction for the non-final
  micro-batches of gradient accumulation (a sum of Partials is a Partial, so the
  accumulated gradients need no collective until the last micro-batch), as FSDP2's
  ``FSDPModule.set_requires_gradient_sync`` does for the data-parallel reduce-scatter;
  on a model that ``fully_shard`` wrapped, the same call sets FSDP's switch too. The
  switch is read when backward ends, as FSDP reads its own.
* Parameters are looked up by name when backward ends (``model.get_parameter``), never
  held, so ``to_empty``, ``.to`` and ``fully_shard`` (which all replace parameters)
  keep working. After ``fully_shard`` FSDP2 itself redistributes a Partial gradient to
  its parameter's tp placement (one all-reduce per parameter, in its post-backward,
  before this reduction runs), so the gradients arrive here already ``Replicate``.
* The end-of-backward callback is queued (``Variable._execution_engine.queue_callback``)
  by a gradient hook that a forward hook of the root module puts on every output tensor:
  nothing is installed inside the blocks, so a block compiled with ``fullgraph=True``
  contains no hook that dynamo would have to break on.
* ``reduce_partial_gradients(model)`` runs the reduction by hand (e.g. after a backward
  that did not start from the model's output); it is a no-op when nothing is Partial.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_leaves

from .styles import _all_reduce

__all__ = ["GradSync", "install_gradient_sync", "set_requires_gradient_sync", "reduce_partial_gradients"]

_ATTR = "_shardplan_gradsync"


@dataclass
class GradSync:
    """What the root module carries: the parameter names whose gradients arrive Partial,
    and the accumulation switch."""

    names: list[str] = field(default_factory=list)
    requires_gradient_sync: bool = True


def install_gradient_sync(model: nn.Module, names: list[str]) -> GradSync:
    """Reduce the Partial gradients of parameters ``names`` (FQNs relative to ``model``)
    once at the end of every backward that starts from ``model``'s output."""
    state = GradSync(names=list(names))
    setattr(model, _ATTR, state)
    if state.names:
        model.register_forward_hook(_arm)
    return state


def _arm(module: nn.Module, args: Any, output: Any) -> None:
    # a hook on each output's gradient fires inside backward, where a callback may be queued
    if not torch.is_grad_enabled():
        return
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(partial(_queue, module=module))


def _queue(grad: torch.Tensor, *, module: nn.Module) -> None:
    # one callback per output tensor reached; after the first, nothing is Partial any more
    torch.autograd.Variable._execution_engine.queue_callback(partial(_end_of_backward, module))


def _end_of_backward(module: nn.Module) -> None:
    state = getattr(module, _ATTR, None)
    if state is not None and state.requires_gradient_sync:
        reduce_partial_gradients(module)


def reduce_partial_gradients(model: nn.Module) -> int:
    """All-reduce every Partial gradient of the registered parameters to Replicate, one
    collective per (mesh, dtype) bucket; returns the number of gradients reduced."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no shardplan gradient sync; expected a model "
                         "that shardplan.apply_plan sharded (pass the model apply_plan returned)")
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for name in state.names:
        param = model.get_parameter(name)
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            buckets.setdefault(_bucket_key(grad), []).append(param)
    with torch.no_grad():
        for key, params in buckets.items():
            if key[0] is None:  # not a plain sum on one mesh axis: let DTensor do it, one by one
                for p in params:
                    p.grad = p.grad.redistribute(placements=p.placements)
            else:
                _reduce_bucket(params, axis=key[1])
    return sum(len(ps) for ps in buckets.values())


def _bucket_key(grad: DTensor) -> tuple:
    """Gradients Partial (a sum) on exactly one mesh axis, whatever they are on the others (a
    kv weight ``[Shard(0), Partial()]`` on the unflattened tp axis), share one all-reduce
    over that axis's group."""
    partial = [i for i, p in enumerate(grad.placements) if p.is_partial()]
    if len(partial) != 1 or getattr(grad.placements[partial[0]], "reduce_op", None) != "sum":
        return (None, id(grad))
    return (grad.device_mesh, partial[0], grad.placements, grad.dtype, grad.device)


def _reduce_bucket(params: list[nn.Parameter], *, axis: int) -> None:
    """Flatten the local Partial summands into one buffer, sum it over the group of mesh axis
    ``axis``, copy each slice back into its own local tensor and relabel that axis Replicate."""
    mesh, placements = params[0].grad.device_mesh, list(params[0].grad.placements)
    placements[axis] = Replicate()
    locals_ = [p.grad.to_local() for p in params]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    out = _all_reduce(flat, mesh.get_group(axis).group_name)
    offset = 0
    for p, local in zip(params, locals_):
        local.copy_(out[offset:offset + local.numel()].view_as(local))
        offset += local.numel()
        p.grad = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether the next backwards end with the gradient reductions: ``False`` for the
    non-final micro-batches of gradient accumulation, ``True`` (the default) for the last.

    Sets shardplan's switch (the sequence-parallel norms' tp all-reduce) on every sharded
    module in ``model`` and, where ``fully_shard`` wrapped modules, FSDP2's own switch
    (its data-parallel reduce-scatter), so one call covers both."""
    if not isinstance(requires_gradient_sync, bool):
        raise ValueError(f"requires_gradient_sync must be True or False; got {requires_gradient_sync!r}")
    from torch.distributed.fsdp import FSDPModule

    found = False
    for mod in model.modules():
        state = getattr(mod, _ATTR, None)
        if isinstance(state, GradSync):
            state.requires_gradient_sync = requires_gradient_sync
            found = True
        if isinstance(mod, FSDPModule):
            mod.set_requires_gradient_sync(requires_gradient_sync, recurse=False)
            found = True
    if not found:
        raise ValueError(f"{type(model).__name__} was neither sharded by shardplan.apply_plan nor wrapped by "
                         "fully_shard, so it has no gradient sync to switch; apply a plan first")
