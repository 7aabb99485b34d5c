"""Elementwise modules with scalar parameters: a learnable activation (Apertus's xIELU,
``nn.PReLU()``, a learnable temperature applied entry by entry).

Contract
--------
``scalar_elementwise_dims(op, graph, tp)`` lists the dims of the module's input along which
it acts entry by entry, tp dividing them, when every parameter and buffer it holds is a
scalar (one element) and its output is shaped as its input; otherwise ``[]``. Such a module
may run on a shard of any of those dims, its parameters whole
(``replicated_with_grad_allreduce``): each rank's gradient of a scalar is the sum over its
own entries, so the step all-reduces it, as for a sequence-parallel norm's weight.

Whether a module acts entry by entry is not read off its class (a softmax with a learned
temperature has scalar parameters too) but measured: a copy with random scalars runs on a
small random input and on each half of it along the dim, on the CPU, and the halves must
give the halves of the output. The answer is a yes or no, the same on every machine.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..analyze.graph import Op, OpGraph

__all__ = ["scalar_elementwise_dims"]

_PROBE_SIZE = 4  # entries per probed dim: halves of 2 on each side


def scalar_elementwise_dims(op: Op, graph: OpGraph, tp: int) -> list[int]:
    if len(op.inputs) != 1 or op.output is None:
        return []
    module = graph.model.get_submodule(op.target)
    state = list(module.parameters()) + list(module.buffers())
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    if not any(p.requires_grad for p in state) or any(t.numel() != 1 for t in state) or x.shape != y.shape:
        return []
    dims = [d for d, n in enumerate(x.shape) if n % tp == 0 and n >= tp]
    key = ("scalar elementwise", op.target)
    if key not in graph.strategy_cache:
        graph.strategy_cache[key] = _measured_dims(module, len(x.shape))
    return [d for d in dims if d in graph.strategy_cache[key]]


def _measured_dims(module: nn.Module, ndim: int) -> frozenset[int]:
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in list(probe.parameters()) + list(probe.buffers()):
            t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        x = torch.randn((_PROBE_SIZE,) * ndim, generator=gen)
        try:
            whole = probe(x)
            return frozenset(d for d in range(ndim) if _halves_agree(probe, x, whole, d))
        except Exception:  # noqa: BLE001 - a module that cannot run on a small CPU input is not judged elementwise
            return frozenset()


def _halves_agree(probe: nn.Module, x: torch.Tensor, whole: torch.Tensor, d: int) -> bool:
    if not isinstance(whole, torch.Tensor) or whole.shape != x.shape:
        return False
    parts = [probe(h) for h in x.split(_PROBE_SIZE // 2, dim=d)]
    return all(isinstance(p, torch.Tensor) and torch.allclose(p, w, rtol=1e-5, atol=1e-6)
               for p, w in zip(parts, whole.split(_PROBE_SIZE // 2, dim=d)))
