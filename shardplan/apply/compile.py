"""Compile: ``torch.compile`` each repeated block of a sharded model, as torchtitan does.

Contract
--------
``compile_blocks(model, plan, **compile_kwargs)`` calls ``block.compile(**compile_kwargs)``
(``fullgraph=True`` unless given) on every child of every container the plan folded
(``plan.model.repeats``: ``layers.0``, ``layers.1``, ...), so FQNs, ``state_dict`` and the
plan's patterns are unchanged. It returns the compiled blocks' FQNs.

Why it does more than call ``compile``: ``RowwiseParallel`` (a vocab-sharded
``tok_embeddings``) and ``ColwiseParallel`` redistribute their DTensor output with
``async_op=True`` and hand on ``to_local()`` of it, which is an un-waited
``AsyncCollectiveTensor``. When that tensor is the input of a compiled block, the compiled
backward (torch 2.13, any backend, ``aot_eager`` included) returns ``None`` as its gradient;
``_ToTorchTensor.backward`` passes the ``None`` on, ``Redistribute.backward`` receives it
materialized as a plain zero tensor and ``NestedRedistribute.forward`` fails on
``grad_output._local_tensor`` (``'Tensor' object has no attribute '_local_tensor'``); had it
not failed, the embedding would have got no gradient. So every module outside the blocks
gets a forward hook that waits for such an output and hands on a plain tensor through an
identity whose backward passes the gradient through (no copy, no collective). Inside a
whole-model compile no ``AsyncCollectiveTensor`` crosses a graph boundary, so none is
needed there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_leaves, tree_map

from ..plan.model import Plan, expand_pattern

__all__ = ["compile_blocks"]

_HOOKED = "_shardplan_waits_async_output"


def compile_blocks(model: nn.Module, plan: Plan, **compile_kwargs: Any) -> list[str]:
    """``torch.compile`` every repeated block of ``model`` in place; returns their FQNs."""
    if not isinstance(plan, Plan):
        raise ValueError(f"compile_blocks needs the shardplan Plan the model was sharded with; got {type(plan).__name__}")
    blocks = _blocks(plan)
    if not blocks:
        raise ValueError(f"the plan for {plan.model.class_name} records no repeated blocks (plan.model.repeats is empty); "
                         "compile the whole model instead: model.compile()")
    compile_kwargs.setdefault("fullgraph", True)
    for fqn in blocks:
        model.get_submodule(fqn).compile(**compile_kwargs)
    inside = tuple(f"{b}." for b in blocks)
    for fqn, mod in model.named_modules():
        if fqn not in blocks and not fqn.startswith(inside) and not getattr(mod, _HOOKED, False):
            mod.register_forward_hook(_wait_async_output)
            setattr(mod, _HOOKED, True)
    return blocks


def _blocks(plan: Plan) -> list[str]:
    """The children of the outermost folded containers (a container inside a block is
    compiled with it)."""
    found = [fqn for container in plan.model.repeats for fqn in expand_pattern(f"{container}.*", plan.model.repeats)]
    return [b for b in found if not any(b.startswith(f"{o}.") for o in found if o != b)]


def _wait_async_output(module: nn.Module, args: Any, output: Any) -> Any:
    if not any(isinstance(t, AsyncCollectiveTensor) for t in tree_leaves(output)):
        return None
    return tree_map(lambda t: _Waited.apply(t) if isinstance(t, AsyncCollectiveTensor) else t, output)


class _Waited(torch.autograd.Function):
    """Identity from an ``AsyncCollectiveTensor`` to the plain tensor it wraps, once the
    collective is done; the gradient passes through."""

    @staticmethod
    def forward(ctx, t):  # noqa: ANN001, ANN205 - autograd's signature
        done = t.trigger_wait()
        return done.view_as(done)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad
