"""Conversions at a module's exit: a Partial output reduce-scattered, a whole one cut, onto sequence shards there.

Contract
--------
``scatter_exits(graph)`` maps each value that is the one output of a module call (called
once, or a folded stack's representative) to that module; ``scatter_twins(op, graph,
strategies)`` gives an op reading such a value, for each of its strategies that reads it as
``Shard(d)`` (or as tokens the module flattened, ``S0p{b}``), a twin that reads it ``P`` (a
partial sum, as the module's code leaves it) with the entry ``P>S{d}``; ``sum_twins`` does
the same for a whole read, ``P>R`` (one all-reduce where the module returns). ``scatter_rows`` keeps the program honest: the conversion happens once,
where the module returns, so when it is chosen no reader of the value may take it as a plain
partial sum. The region turns into ``PrepareModuleOutput(output_layouts=Partial(),
desired_output_layouts=Shard(d), use_local_output=True)`` on the module: one reduce-scatter
forward, its gradient all-gathered back.

``cut_twins``/``cut_rows`` do the same for a whole value (``R^S{d}``): a module returning a
value every rank holds whole (a block run whole because its code needs whole sequences, a
position-embedding module made of buffers, a gathered activation) hands on its rank's
slice of the sequence: ``PrepareModuleOutput(Replicate -> Shard(d))``, a local slice, its
gradient all-gathered back. :func:`exits` also counts values a weight module makes and its
container returns as they are, which a cut may take where the module's own style cannot.

Why: a mixture-of-experts block under sequence parallel (torchtitan's
``PrepareModuleInputOutput`` on the MoE module). Its experts compute partial sums over the
ranks' slices of every expert on the gathered tokens, and its code flattens the tokens for
routing and reshapes them back (``view(-1, hidden)`` ... ``reshape(b, s, hidden)``), so no
weight module's own output can be the sequence shard the residual stream takes; the module's
return can.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ..analyze.graph import Op, OpGraph, _inside
from .placements import Strategy
from .propagation import metadata_only
from .slices import entry_twins, received_values

__all__ = ["Exit", "flattened_from", "sum_twins", "is_sum", "scatter_exits", "scatter_twins", "scatter_rows", "is_scatter",
           "scatter_target", "gather_entries", "gather_twins", "gather_rows", "is_gather", "is_cut", "cut_twins", "cut_rows", "exits"]

# ``P>S0p{b}``: tokens the module flattened itself (Llama 4's MoE returns ``[b * s, h]``, which
# its layer views by the residual's shape): each rank's sequence shard of every row, in the
# order its own ``[b, s / tp, h]`` flattens to, so the view back gives ``Shard(1)``
# ``P>R``: summed whole where the module returns (one all-reduce for a hand-written MoE whose
# experts' partial sums its loop adds up, rather than one per expert)
_SCATTER = re.compile(r"P>(S\d+|S0p\d+|R)")
# a whole value cut onto sequence shards where its module returns it: a block that ran whole
# (its code sizes by the whole sequence) handing its output back to the residual stream, a
# position-embedding module made of buffers. Replicate -> Shard is a local slice; backward
# all-gathers the gradient, when one flows
_CUT = re.compile(r"R\^(S\d+)")


def is_scatter(entry: str | None) -> bool:
    return bool(entry) and _SCATTER.fullmatch(entry) is not None


def is_cut(entry: str | None) -> bool:
    return bool(entry) and _CUT.fullmatch(entry) is not None


def scatter_target(entry: str) -> str:
    """``P>S1`` or ``R^S1`` -> ``S1``."""
    return (_SCATTER.fullmatch(entry) or _CUT.fullmatch(entry)).group(1)


@dataclass(frozen=True)
class Exit:
    """Where a module returns a value: its one output (``index`` None), or element ``index`` of
    the ``count`` it returns as a tuple (gpt-oss's and Llama 4's ``(hidden, router_scores)``)."""

    module: str
    index: int | None = None
    count: int = 1


def scatter_exits(graph: OpGraph) -> dict[int, Exit]:
    """Value -> where a container module (called once, or a folded stack's representative)
    returns exactly that value, alone or as one element of its tuple, made by its own code
    (a weight module's own style converts its output)."""
    return {v: e for v, e in exits(graph).items() if graph.ops[graph.values[v].producer].kind != "module"}


def exits(graph: OpGraph) -> dict[int, Exit]:
    """:func:`scatter_exits` and the values a weight module makes that its container returns
    as they are (a block run whole returns its gathered ``out_proj``'s output: cut there)."""
    cached = graph.strategy_cache.get("exits")
    if cached is None:
        cached = {}
        for fqn, calls in graph.traced.calls.items():
            if not fqn or fqn in graph.traced.folded or len(calls) != 1:
                continue
            call = calls[0]
            items = sorted(call.items.items()) if call.items else [(None, n) for n in call.outputs[:1]]
            if not items or (not call.items and len(call.outputs) != 1):
                continue
            for index, node in items:
                value = getattr(node, "meta", {}).get("shardplan_op")
                producer = graph.ops[graph.values[value].producer] if value in graph.values else None
                if producer is not None and producer.target != fqn:
                    count = max(call.num_items, len(items)) if index is not None else 1
                    cached.setdefault(value, Exit(fqn, index, count))
        graph.strategy_cache["exits"] = cached
    return cached


def flattened_from(graph: OpGraph, value: int, runs: int) -> int | str | None:
    """The argument of the module returning ``value`` whose ``[b, s, ...]`` its rows flatten
    (``b == runs``, ``b * s`` rows: Llama 4's MoE returns ``[b * s, h]`` of the ``[b, s, h]`` it
    receives): its positional index or keyword; None when ``runs`` is 1 (a plain shard) or no
    argument fits."""
    if runs < 2:
        return None
    cache = graph.strategy_cache.setdefault("flattened from", {})  # asked by the strategies, then the regions
    if (value, runs) not in cache:
        call = graph.traced.calls[exits(graph)[value].module][0]
        rows = graph.values[value].shape[0]
        found = None
        for key, node in [*enumerate(call.args), *call.kwargs.items()]:
            v = getattr(node, "meta", {}).get("shardplan_op") if hasattr(node, "meta") else None
            shape = graph.values[v].shape if v in graph.values else ()
            if len(shape) >= 3 and shape[0] == runs and shape[0] * shape[1] == rows:
                found = key
                break
        cache[(value, runs)] = found
    return cache[(value, runs)]


def scatter_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    exits = scatter_exits(graph)
    slots = [i for i, v in enumerate(op.inputs) if v in exits]
    flat = [t for t in entry_twins(strategies, slots, reads="P", shard=r"S0p\d+")
            if all(flattened_from(graph, v, _runs(e)) is not None for v, e in zip(op.inputs, t.entry) if is_scatter(e))]
    return entry_twins(strategies, slots, reads="P") + flat


def sum_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    """For each strategy of an op (not a weight module's style) reading a module's returned
    value whole, a twin reading it ``P`` with the entry ``P>R``: summed where the module
    returns (``PrepareModuleOutput(Partial -> Replicate)``, one all-reduce forward; backward
    the whole gradient is every rank's share). Offered with or without sequence parallel."""
    if op.kind == "module":
        return []
    exits = scatter_exits(graph)
    return entry_twins(strategies, [i for i, v in enumerate(op.inputs) if v in exits], reads="P", shard="R")


def is_sum(entry: str | None) -> bool:
    """``P>R``: a partial sum all-reduced where its module returns."""
    return entry == "P>R"


def _runs(entry: str) -> int:
    """``b`` of ``P>S0p{b}``."""
    return int(scatter_target(entry).partition("p")[2] or 1)


def cut_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    found = exits(graph)
    return entry_twins(strategies, [i for i, v in enumerate(op.inputs) if v in found], reads="R", arrow="^")


def cut_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """For each chosen cut of a value and each reader of it: ``entry + plain R reads <= 1``
    (the cut's own twins read ``R`` too, with that entry)."""
    _one_way_rows(prog, rows, lo, hi, chosen=is_cut, plain=lambda entry: "R", within=lambda value: None,
                  own=lambda entry, theirs: theirs == entry)


def scatter_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """For each chosen scatter of a value and each reader of it: ``entry + plain P reads <= 1``."""
    _one_way_rows(prog, rows, lo, hi, chosen=is_scatter, plain=lambda entry: "P", within=lambda value: None,
                  own=lambda entry, theirs: bool(theirs))


def _one_way_rows(prog: Any, rows: list, lo: list, hi: list, *, chosen, plain, within, own) -> None:
    """The conversion an entry makes happens once, for every reader (within the modules
    ``within(value)`` gives; None: all of them): when the entry is chosen, no reader takes the
    value as it was before it (``plain(entry)``) unless ``own(entry, its entry)`` says the
    reader converts it itself."""
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
                    if st.inputs[slot] == before and not own(entry, st.entry[slot] if slot < len(st.entry) else None):
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
    """Value -> the modules (called once, or representatives) that receive it as an argument,
    made outside them, and hold an op that flattens its tokens."""
    cached = graph.strategy_cache.get("gather entries")
    if cached is None:
        cached = {}
        for v, modules in received_values(graph).items():
            flat = [op for op in (graph.ops[c] for c in graph.consumers.get(v, [])) if _flattens_tokens(op, graph)]
            keep = tuple(m for m in modules if any(_reads_inside(op, m) for op in flat))
            if keep:
                cached[v] = keep
        graph.strategy_cache["gather entries"] = cached
    return cached


def _flattens_tokens(op: Op, graph: OpGraph) -> bool:
    """A view ``[b, s, h]`` -> ``[b * s, h]`` (routing's ``view(-1, hidden)``), or a module
    returning per-token rows (DeepSeek-V3's router, called on ``[b, s, h]``, flattens them
    itself): no sequence shard passes either."""
    if op.output is None or len(graph.values[op.output].shape) >= 3:
        return False
    return op.kind == "module" or (op.kind == "function" and op.target in ("view", "reshape", "flatten"))


def _reads_inside(op: Op, module: str) -> bool:
    return _inside(op.target, module) if op.kind == "module" else _inside(op.owner, module)


def gather_twins(op: Op, graph: OpGraph, strategies: list[Strategy], tp: int) -> list[Strategy]:
    """For every reader of a sequence shard inside a module that receives it and flattens its
    tokens: once gathered there, each reader takes it whole, so each strategy reading it
    ``R`` gets a twin reading ``S{d}`` with the entry ``S{d}>R``. A Linear's own ``R`` entry
    summed its Partial input gradient; it still does (its style's all-reduce), so the twin
    keeps that cost. Elsewhere the module's own ops keep the shards, and gathering for them
    would run the block whole."""
    if op.kind not in ("module", "function") or metadata_only(op):
        return []
    entries = gather_entries(graph)
    slots = [i for i, v in enumerate(op.inputs) if any(_reads_inside(op, m) for m in entries.get(v, ()))]
    out = []
    for s in strategies:
        for i in slots:
            shape = graph.values[op.inputs[i]].shape
            own = s.entry[i] if i < len(s.entry) else None
            if i >= len(s.inputs) or s.inputs[i] != "R" or own not in (None, "R") or len(shape) != 3 or shape[1] % tp:
                continue
            inputs = s.inputs[:i] + ("S1",) + s.inputs[i + 1:]
            entry = tuple("S1>R" if j == i else (s.entry[j] if j < len(s.entry) else None) for j in range(len(s.inputs)))
            bwd = s.bwd + (("all_reduce", graph.values[op.inputs[i]].nbytes),) if own == "R" else s.bwd
            out.append(replace(s, inputs=inputs, entry=entry, bwd=bwd))
    return out


def gather_rows(prog: Any, rows: list, lo: list, hi: list) -> None:
    """A gather at a module's entry hands every reader inside it the whole value: when chosen,
    no reader inside that module takes the shard as it is (``entry + plain S reads <= 1``)."""
    _one_way_rows(prog, rows, lo, hi, chosen=is_gather, plain=lambda entry: entry.split(">")[0],
                  within=lambda value: gather_entries(prog.graph).get(value, ()),
                  # a Linear gathering the shard on its own entry would gather the gathered value again
                  own=lambda entry, theirs: theirs == entry)
