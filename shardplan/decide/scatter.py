"""Scatters at a module's exit: a Partial output reduce-scattered onto sequence shards there.

Contract
--------
``scatter_exits(graph)`` maps each value that is the one output of a module call (called
once, or a folded stack's representative) to that module; ``scatter_twins(op, graph,
strategies)`` gives an op reading such a value, for each of its strategies that reads it as
``Shard(d)``, a twin that reads it ``P`` (a partial sum, as the module's code leaves it) with
the entry ``P>S{d}``. ``scatter_rows`` keeps the program honest: the conversion happens once,
where the module returns, so when it is chosen no reader of the value may take it as a plain
partial sum. The region turns into ``PrepareModuleOutput(output_layouts=Partial(),
desired_output_layouts=Shard(d), use_local_output=True)`` on the module: one reduce-scatter
forward, its gradient all-gathered back.

Why: a mixture-of-experts block under sequence parallel (torchtitan's
``PrepareModuleInputOutput`` on the MoE module). Its experts compute partial sums over the
ranks' slices of every expert on the gathered tokens, and its code flattens the tokens for
routing and reshapes them back (``view(-1, hidden)`` ... ``reshape(b, s, hidden)``), so no
weight module's own output can be the sequence shard the residual stream takes; the module's
return can.
"""

from __future__ import annotations

import re
from typing import Any

from ..analyze.graph import Op, OpGraph, _inside
from .placements import Strategy
from .propagation import metadata_only
from .slices import entry_twins, received_values

__all__ = ["scatter_exits", "scatter_twins", "scatter_rows", "is_scatter", "scatter_target", "gather_entries",
           "gather_twins", "gather_rows", "is_gather"]

_SCATTER = re.compile(r"P>(S\d+)")


def is_scatter(entry: str | None) -> bool:
    return bool(entry) and _SCATTER.fullmatch(entry) is not None


def scatter_target(entry: str) -> str:
    """``P>S1`` -> ``S1``."""
    return _SCATTER.fullmatch(entry).group(1)


def scatter_exits(graph: OpGraph) -> dict[int, str]:
    """Value -> the container module whose call returns exactly that value."""
    cached = graph.strategy_cache.get("scatter exits")
    if cached is None:
        cached = {}
        for fqn, calls in graph.traced.calls.items():
            if not fqn or fqn in graph.traced.folded or len(calls) != 1 or len(calls[0].outputs) != 1:
                continue
            node = calls[0].outputs[0]
            value = getattr(node, "meta", {}).get("shardplan_op")
            producer = graph.ops[graph.values[value].producer] if value in graph.values else None
            if producer is not None and producer.kind != "module":  # a weight module's own style converts its output
                cached.setdefault(value, fqn)
        graph.strategy_cache["scatter exits"] = cached
    return cached


def scatter_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    exits = scatter_exits(graph)
    return entry_twins(strategies, [i for i, v in enumerate(op.inputs) if v in exits], reads="P")


def scatter_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """For each chosen scatter of a value and each reader of it: ``entry + plain P reads <= 1``."""
    _one_way_rows(prog, rows, lo, hi, chosen=is_scatter, plain=lambda entry: "P", within=lambda value: None)


def _one_way_rows(prog: Any, rows: list, lo: list, hi: list, *, chosen, plain, within) -> None:
    """The conversion an entry makes happens once, for every reader (within the modules
    ``within(value)`` gives; None: all of them): when the entry is chosen, no reader takes the
    value as it was before it (``plain(entry)``) without that entry."""
    graph = prog.graph
    for (value, entry), col in prog.entry_of.items():
        if not chosen(entry):
            continue
        before, modules = plain(entry), within(value)
        for c in graph.consumers.get(value, []):
            op = graph.ops[c]
            owner = op.target if op.kind == "module" else op.owner
            if metadata_only(op) or (modules is not None and not any(_inside(owner, m) for m in modules)):
                continue
            row = {col: 1.0}
            for slot, v in enumerate(op.inputs):
                for i, st in enumerate(prog.strategies[c] if v == value else ()):
                    if st.inputs[slot] == before and not (slot < len(st.entry) and st.entry[slot]):
                        row[prog.var_of[(c, i)]] = 1.0
            rows.append(row)
            lo.append(float("-inf"))
            hi.append(1.0)


# --- the other side: a sequence shard gathered where such a module receives it ---------------
# Its code flattens the tokens (``view(-1, hidden)`` for routing), which no sequence shard
# survives, and the reader is that view, not a Linear that could gather on entry itself. ``S{d}>R``: all-gather forward; the
# readers take the value whole (``R``), whose gradient the program always completes (a
# reader's Partial gradient is summed by its own entry), so backward slices it: no collective.

_GATHER = re.compile(r"(S\d+)>R")


def is_gather(entry: str | None) -> bool:
    return bool(entry) and _GATHER.fullmatch(entry) is not None


def gather_entries(graph: OpGraph) -> dict[int, tuple[str, ...]]:
    """Value -> the container modules (called once, or representatives) that receive it as an
    argument, made outside them."""
    return received_values(graph)


def gather_twins(op: Op, graph: OpGraph, strategies: list[Strategy], tp: int) -> list[Strategy]:
    """Only for a view that flattens the tokens (``[b, s, h]`` -> ``[b * s, h]``, routing's
    ``view(-1, hidden)``), where no sequence shard can pass: elsewhere the module's own ops
    keep the shards, and gathering for them would run the block whole."""
    if op.kind != "function" or op.target not in ("view", "reshape", "flatten") or op.output is None:
        return []
    if len(graph.values[op.output].shape) >= 3:
        return []
    entries = gather_entries(graph)
    slots = [i for i, v in enumerate(op.inputs) if any(_inside(op.owner, m) for m in entries.get(v, ()))]
    out = []
    for s in strategies:
        if s.name or s.entry:
            continue
        for i in slots:
            shape = graph.values[op.inputs[i]].shape
            if i < len(s.inputs) and s.inputs[i] == "R" and len(shape) == 3 and shape[1] % tp == 0:
                inputs = s.inputs[:i] + ("S1",) + s.inputs[i + 1:]
                entry = tuple("S1>R" if j == i else None for j in range(len(s.inputs)))
                out.append(Strategy("", inputs, s.output, entry=entry))
    return out


def gather_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """A gather at a module's entry hands every reader inside it the whole value: when chosen,
    no reader inside that module takes the shard as it is (``entry + plain S reads <= 1``)."""
    _one_way_rows(prog, rows, lo, hi, chosen=is_gather, plain=lambda entry: entry.split(">")[0],
                  within=lambda value: gather_entries(prog.graph).get(value, ()))
