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

from ..analyze.graph import Op, OpGraph
from .placements import Strategy
from .propagation import metadata_only

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
    slots = [i for i, v in enumerate(op.inputs) if v in exits]
    out = []
    for s in strategies:
        if s.name or s.entry:
            continue
        for i in slots:
            p = s.inputs[i] if i < len(s.inputs) else None
            if p is not None and re.fullmatch(r"S\d+", p):
                inputs = s.inputs[:i] + ("P",) + s.inputs[i + 1:]
                entry = tuple(f"P>{p}" if j == i else None for j in range(len(s.inputs)))
                out.append(Strategy("", inputs, s.output, entry=entry))
    return out


def scatter_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """For each chosen scatter of a value and each reader of it: ``entry + plain P reads <= 1``."""
    graph = prog.graph
    for (value, entry), col in prog.entry_of.items():
        if not is_scatter(entry):
            continue
        for c in graph.consumers.get(value, []):
            if metadata_only(graph.ops[c]):
                continue
            row = {col: 1.0}
            for slot, v in enumerate(graph.ops[c].inputs):
                if v != value:
                    continue
                for i, st in enumerate(prog.strategies[c]):
                    if st.inputs[slot] == "P" and not (slot < len(st.entry) and st.entry[slot]):
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
    cached = graph.strategy_cache.get("gather entries")
    if cached is None:
        found: dict[int, list[str]] = {}
        for fqn, calls in graph.traced.calls.items():
            if not fqn or fqn in graph.traced.folded or len(calls) != 1:
                continue
            for a in list(calls[0].args) + list(calls[0].kwargs.values()):
                v = getattr(a, "meta", {}).get("shardplan_op") if hasattr(a, "meta") else None
                if v in graph.values and not _inside(graph.ops[graph.values[v].producer].owner, fqn):
                    found.setdefault(v, []).append(fqn)
        cached = graph.strategy_cache["gather entries"] = {v: tuple(sorted(m)) for v, m in found.items()}
    return cached


def _inside(fqn: str, module: str) -> bool:
    return fqn == module or fqn.startswith(module + ".")


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
    graph = prog.graph
    for (value, entry), col in prog.entry_of.items():
        if not is_gather(entry):
            continue
        shard = entry.split(">")[0]
        modules = gather_entries(graph).get(value, ())
        for c in graph.consumers.get(value, []):
            op = graph.ops[c]
            owner = op.target if op.kind == "module" else op.owner
            if metadata_only(op) or not any(_inside(owner, m) for m in modules):
                continue
            row = {col: 1.0}
            for slot, v in enumerate(op.inputs):
                if v != value:
                    continue
                for i, st in enumerate(prog.strategies[c]):
                    if st.inputs[slot] == shard and not (slot < len(st.entry) and st.entry[slot]):
                        row[prog.var_of[(c, i)]] = 1.0
            rows.append(row)
            lo.append(float("-inf"))
            hi.append(1.0)
