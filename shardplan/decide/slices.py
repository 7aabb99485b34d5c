"""Slices at a module's entry: a whole value, read beside values split by heads, cut there.

Contract
--------
``slice_entries(graph)`` maps each value that may be sliced where it enters a module to the
modules that receive it as an argument; ``slice_twins(op, graph, strategies)`` gives an op
inside such a module, for each of its strategies that reads the value as ``Shard(d)``, a
twin that reads it whole (``R``, as its producer hands it) with the entry ``R>S{d}``. The
solver prices that entry at nothing and requires every consumer inside the module to take
it; the region turns into ``PrepareModuleInput(input_layouts=Replicate(),
desired_input_layouts=Shard(d), use_local_output=True)`` on the module: Replicate ->
Shard is a local slice, no collective, and the module's code then sees its rank's part.

Only values no gradient flows into qualify (an ALiBi bias made from the mask: MPT's
``position_bias`` of ``[heads, 1, keys]``, added to scores split by heads), so the slice
has no backward; a value with a gradient would need its gradient all-gathered back.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..analyze.graph import Op, OpGraph, _inside
from .placements import Strategy
from .propagation import metadata_only

__all__ = ["received_values", "slice_entries", "slice_twins", "entry_twins", "slice_rows", "is_slice", "slice_target", "place"]

# ``S{d}p{k}``: heads folded into the batch (Bloom's ALiBi of ``[b * heads, 1, keys]`` beside
# scores folded the same way): each rank's heads of every one of the ``k`` blocks
_SLICE = re.compile(r"R>(S\d+(?:p\d+)?)")


def is_slice(entry: str | None) -> bool:
    return bool(entry) and _SLICE.fullmatch(entry) is not None


def slice_target(entry: str) -> str:
    """``R>S0`` -> ``S0``."""
    return _SLICE.fullmatch(entry).group(1)


def place(op: Op) -> str:
    """Where an op runs: a weight module is its own FQN, any other op the module whose code calls it."""
    return op.target if op.kind == "module" else op.owner


def received_values(graph: OpGraph) -> dict[int, tuple[str, ...]]:
    """Value -> the modules (called once, not a folded copy) that receive it as an argument,
    made outside them."""
    cached = graph.strategy_cache.get("received values")
    if cached is None:
        found: dict[int, list[str]] = {}
        for fqn, calls in graph.traced.calls.items():
            if not fqn or fqn in graph.traced.folded or len(calls) != 1:
                continue
            call = calls[0]
            for a in list(call.args) + list(call.kwargs.values()):
                v = getattr(a, "meta", {}).get("shardplan_op") if hasattr(a, "meta") else None
                if v not in graph.values:
                    continue
                producer = graph.ops[graph.values[v].producer]
                if not _inside(producer.owner, fqn) and producer.target != fqn:
                    found.setdefault(v, []).append(fqn)
        cached = graph.strategy_cache["received values"] = {v: tuple(sorted(m)) for v, m in found.items()}
    return cached


def slice_entries(graph: OpGraph) -> dict[int, tuple[str, ...]]:
    """:func:`received_values` that need no gradient."""
    return {v: m for v, m in received_values(graph).items() if v not in graph.requires_grad}


def slice_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    entries = slice_entries(graph)
    slots = [i for i, v in enumerate(op.inputs) if any(_inside(op.owner, m) for m in entries.get(v, ()))]
    return entry_twins(strategies, slots, reads="R", folded=True)


def entry_twins(strategies: list[Strategy], slots: list[int], *, reads: str, arrow: str = ">",
                folded: bool = False) -> list[Strategy]:
    """For each strategy that reads input ``i`` (in ``slots``) as ``Shard(d)``, a twin that
    reads it ``reads`` (``R``: a whole value cut; ``P``: a partial sum reduce-scattered) with
    the entry ``{reads}{arrow}S{d}`` that makes it the shard there (``>``: where a module
    receives it or, a partial sum, returns it; ``^``: a whole value where its module returns it).
    ``folded``: a folded ``S{d}p{k}`` read qualifies too (a whole value cut needs no collective
    whatever blocks it is cut in)."""
    shard = re.compile(r"S\d+(?:p\d+)?" if folded else r"S\d+")
    out = []
    for s in strategies:
        for i in slots:
            p = s.inputs[i] if i < len(s.inputs) else None
            if p is None or not shard.fullmatch(p) or any(s.entry):
                continue
            inputs = s.inputs[:i] + (reads,) + s.inputs[i + 1:]
            entry = tuple(f"{reads}{arrow}{p}" if j == i else None for j in range(len(s.inputs)))
            # a weight module's style (a sequence-parallel norm after a MoE block) keeps its costs
            out.append(replace(s, inputs=inputs, entry=entry) if s.name else Strategy("", inputs, s.output, entry=entry))
    return out


def slice_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """The program's rows (``prog`` is :mod:`.solve`'s): a value cut where a module receives
    it is cut for all of that module, every op inside it that reads the value (its size
    aside) taking the same slice, or none doing so: ``entry <= each reader's slice columns``."""
    graph = prog.graph
    for (value, entry), col in prog.entry_of.items():
        if not is_slice(entry):
            continue
        modules = slice_entries(graph).get(value, ())
        for c in graph.consumers.get(value, []):
            op = graph.ops[c]
            if op.kind == "folded" or metadata_only(op) or not any(_inside(place(op), m) for m in modules):
                continue
            row = {col: 1.0}
            for slot, v in enumerate(op.inputs):
                if v != value:
                    continue
                for i, st in enumerate(prog.strategies[c]):
                    if slot < len(st.entry) and st.entry[slot] == entry:
                        row[prog.var_of[(c, i)]] = row.get(prog.var_of[(c, i)], 0.0) - 1.0
            rows.append(row)
            lo.append(float("-inf"))
            hi.append(0.0)
