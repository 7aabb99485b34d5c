"""Written buffers: a model tensor the forward writes activations into, split as they are.

Contract
--------
Meta's reference Llama and many inference-ready research models keep a KV cache in the
attention module (``register_buffer("cache_k", zeros(B, S_max, kv_heads, hd),
persistent=False)`` or a plain ``self.cache_k = zeros(...)``) and write each call's keys
into it: ``self.cache_k[:b, p:p + s] = xk``, then read ``keys = self.cache_k[:b, :p + s]``.
With the keys split by heads, a whole cache would need them gathered to be written, so
attention would run whole. An expert's plan (Megatron, vLLM) holds each rank's heads of the
cache: the buffer is split on the dim the writes split (``Shard(2)``, kv heads), writes and
reads stay on the rank's shard, and nothing is communicated.

``written_buffers(graph)`` names the ``const`` reads of such tensors: a tensor attribute of
a module that is not a parameter (a buffer, persistent or not, or a plain attribute), written
in forward, directly or through ``to``/``type_as`` (``self.cache_k = self.cache_k.to(xq)``,
Meta's code) or a slice, and read back. Their strategies are the placements tp divides and,
with fewer kv heads than tp, kv-head groups (``S{d}g{n}``); the solver keeps every write's
target on one placement (:func:`.propagation.in_place_strategies`). ``buffer_layouts`` turns
the chosen ones into the plan's ``buffers`` entries, which the apply stage replaces by each
rank's chunk (:func:`shardplan.apply.buffers.set_local_buffers`). A persistent buffer
(gpt-fast's cache) is in the state dict, where the apply stage presents its chunk as a
``Shard(d)`` DTensor; kv-head groups have no such spelling, so a persistent buffer is never
grouped, and ``saved_buffer_warnings`` says so where its kv heads are fewer than tp.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..analyze.graph import LIKE_OPS, Op, OpGraph, same_data, writes
from ..plan.model import LocalBuffers, persistent_buffer
from .placements import Strategy, group_counts, grouped, groups_of, placement_str
from .propagation import _candidates

__all__ = ["written_buffers", "saved_buffer", "buffer_strategies", "buffer_layouts", "saved_buffer_warnings"]

# ops whose result is their first input's data (same values, maybe another dtype or device)
_SAME_DATA = LIKE_OPS | {"contiguous", "float", "half", "bfloat16", "detach"}


def written_buffers(graph: OpGraph) -> dict[int, tuple[str, str]]:
    """``const`` op index -> (owner module FQN, attribute name) of every written buffer."""
    return {i: where for i, (where, _) in _written(graph).items()}


def saved_buffer(graph: OpGraph, const: int) -> bool:
    """Whether the written buffer ``const`` reads is in the state dict (a persistent buffer)."""
    return _written(graph)[const][1]


def _written(graph: OpGraph) -> dict[int, tuple[tuple[str, str], bool]]:
    """Every model tensor written in forward: its (owner, name) and whether it is saved."""
    cached = graph.strategy_cache.get("written_buffers")
    if cached is None:
        consts = {_source_const(graph, op.inputs[0]) for op in graph.ops if writes(op)} - {None}
        cached = graph.strategy_cache["written_buffers"] = {
            i: found for i in sorted(consts)
            if (found := _held_tensor(graph, graph.ops[i].target)) is not None and _read_back(graph, i)}
    return cached


def _read_back(graph: OpGraph, const: int) -> bool:
    """Whether the graph reads the tensor (or what a write into it returns) other than to
    write it. A cache is written to be read: where the trace shows no read, the code read it
    through a reference the tracer did not follow (a plain attribute read through a local
    name, ``cache_k = self.cache_k; cache_k[...] = k; keys = cache_k[...]``), that read ran as
    a constant, and a split cache would hand the attention its rank's heads where the plan
    holds all of them."""
    stack, reads = [const], 0
    while stack:
        value = stack.pop()
        for c in graph.consumers.get(value, []):
            op = graph.ops[c]
            if op.inputs[0] == value and (writes(op) or op.target in _SAME_DATA):
                stack += [op.output] if op.output is not None else []
            else:
                reads += 1
    return reads > 0


def _source_const(graph: OpGraph, value: int) -> int | None:
    """The ``const`` whose data ``value`` is, or a slice of (``self.k[:n]``, litgpt's write)."""
    op = graph.ops[graph.values[same_data(graph, value, _SAME_DATA)[-1]].producer]
    return op.index if op.kind == "const" else None


def _held_tensor(graph: OpGraph, target: str) -> tuple[tuple[str, str], bool] | None:
    owner, _, name = target.rpartition(".")
    try:
        module = graph.model.get_submodule(owner)
    except AttributeError:
        return None
    if name in module._buffers:
        return (owner, name), persistent_buffer(module, name)
    value = module.__dict__.get(name)
    return ((owner, name), False) if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) else None


def saved_buffer_warnings(graph: OpGraph, solution: Any, tp: int, patterned: Callable[[str], list[str]]) -> list[str]:
    """A persistent cache whose kv heads are fewer than tp and that the solution keeps whole
    (groups have no state-dict spelling): what is written into it is gathered, said with the
    write and the fix."""
    from ..analyze.trace import _user_line

    out = []
    for index, ((owner, name), saved) in _written(graph).items():
        shape = graph.values[index].shape
        if not saved or solution.strategies[index].output not in ("R", "Rp") or not set(shape) & set(group_counts(tp)):
            continue
        write = next((c for c in graph.consumers.get(index, []) if writes(graph.ops[c])), None)
        line = f" ({_user_line(graph.ops[write].node)})" if write is not None else ""
        out.append(f"{patterned(owner)[0]}.{name}: a persistent buffer written in forward{line} is kept whole: its kv "
                   f"heads are fewer than tp={tp}, and a state-dict entry cannot hold them in groups, so what is written "
                   "into it is gathered; register it with persistent=False (a cache need not be saved) to keep each "
                   "rank's kv heads in it")
    return out


def buffer_strategies(op: Op, graph: OpGraph, tp: int, *, groups: bool, partial: bool) -> list[Strategy]:
    """Whole, or split on a dim tp divides, or (``groups``: the model has fewer kv heads
    than tp) a dim of ``n`` kv heads held in ``n`` groups of ``tp / n`` ranks (``S{d}g{n}``:
    each rank keeps the heads its query heads read), or (``partial``: one kv head broadcast
    to heads split tp ways, MQA) whole with partial gradients, ``Rp``, as the key written
    into it. The writes and reads decide which."""
    shape = graph.values[op.output].shape
    groups = groups and not saved_buffer(graph, op.index)  # a state-dict entry is one DTensor: no groups
    places = _candidates(shape, tp) + [grouped(d, n) for n in group_counts(tp) if groups for d, size in enumerate(shape) if size == n]
    places += ["Rp"] if partial and op.output in graph.requires_grad else []
    return [Strategy("", (), p, layouts={"buffer": p}) for p in places]


def buffer_layouts(graph: OpGraph, solution: Any, patterned: Callable[[str], list[str]]) -> list[LocalBuffers]:
    """The plan's ``buffers`` entries: each split buffer's module (as its rules name it),
    layout, and group count where it holds kv heads in groups."""
    found: dict[str, tuple[dict[str, str], dict[str, int]]] = {}
    for index, (owner, name) in sorted(written_buffers(graph).items()):
        placement = solution.strategies[index].output
        if placement and placement.startswith("S"):
            for module in patterned(owner):
                layouts, groups = found.setdefault(module, ({}, {}))
                layouts[name] = placement_str(placement)
                kind = groups_of(placement)
                if kind:
                    groups[name] = kind[1]
    return [LocalBuffers(module=m, layouts=layouts, groups=groups,
                         why="written in forward with values split this way: each rank keeps its shard"
                         + ("; kv heads in groups, each held by the ranks whose query heads read it" if groups else ""))
            for m, (layouts, groups) in found.items()]
