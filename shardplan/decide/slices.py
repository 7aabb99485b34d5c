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

A value no gradient flows into may be cut on any dim (an ALiBi bias made from the mask:
MPT's ``position_bias`` of ``[heads, 1, keys]``, added to scores split by heads): the slice
has no backward. A value with a gradient is cut only onto sequence shards (``Shard(1)``):
the residual stream a model's top-level code makes (``tok(idx) + self.pe[:, :T]``) cut
where the first block receives it, as Megatron scatters after its embeddings; backward
all-gathers its gradient. Where the folded copies of that block receive another value
(the block before's output, :func:`received_once`), the cut is the representative's only.

``inner_cut_twins(op, graph, strategies)`` does the same for a value the module's own code
makes (ALiBi slopes computed in the attention's forward from ``self.n_heads``, or read from
a buffer, then ``slopes[:, None, None] * rel`` added to the scores): no module receives it,
so it is cut where the op that reads it beside the split values is called, with the entry
``R~S{d}``. ``inner_cuts(graph, solution.strategies)`` lists those cuts by the module whose code makes
the call; the local check finds each call in that module's forward and records it
(:class:`~shardplan.plan.model.SliceFix`), run by the same mode as local views.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Collection

from torch import nn

from ..analyze.graph import Op, OpGraph, _inside
from ..analyze.trace import is_weight_leaf
from .placements import Strategy
from .propagation import metadata_only

__all__ = ["received_values", "received_once", "slice_entries", "slice_twins", "entry_twins", "slice_rows", "is_slice", "slice_target", "place",
           "inner_cut_twins", "is_inner_cut", "inner_cuts", "InnerCut"]

# ``S{d}p{k}``: heads folded into the batch (Bloom's ALiBi of ``[b * heads, 1, keys]`` beside
# scores folded the same way): each rank's heads of every one of the ``k`` blocks
_SLICE = re.compile(r"R>(S\d+(?:p\d+)?)")


# ``R~S{d}``: a whole value made in a module's own code, cut where an op of that code reads it
_INNER = re.compile(r"R~(S\d+)")


@dataclass(frozen=True)
class InnerCut:
    """Op ``op``'s ``slot``-th tensor input, whole, cut to ``target`` (``S{d}``) where it is read."""

    op: int
    slot: int
    target: str


def is_inner_cut(entry: str | None) -> bool:
    return bool(entry) and _INNER.fullmatch(entry) is not None


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
                v = _value_of(a)
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


def slice_twins(op: Op, graph: OpGraph, strategies: list[Strategy], *, sequence: bool = True,
                returned: Collection[int] = ()) -> list[Strategy]:
    """Twins reading a received value whole and cutting it where its module receives it: a
    value no gradient reaches on any dim its readers split (a bias by heads); a value with a
    gradient only onto sequence shards (``Shard(1)``, with ``sequence``): the residual stream
    a model's own top-level code makes (``tok(idx) + self.pe[:, :T]``), cut where the first
    block receives it, Megatron's scatter after the embeddings, its gradient all-gathered;
    not a value a module returns (``returned``: cut where it returns instead)."""
    received = received_values(graph)
    whole = [i for i, v in enumerate(op.inputs) if v not in graph.requires_grad
             and any(_inside(place(op), m) for m in received.get(v, ()))]
    # a block's, not a weight module's: a norm cutting its own input would leave the other
    # readers of the stream (the residual add) whole; and only a value no module returns (a
    # module's return is cut where it returns, scatter.cut_twins)
    rows = [i for i, v in enumerate(op.inputs) if v in graph.requires_grad and sequence and len(graph.values[v].shape) == 3
            and v not in returned and any(_inside(place(op), m) for m in received.get(v, ()) if _block(graph, m))]
    return entry_twins(strategies, whole, reads="R", folded=True) + entry_twins(strategies, rows, reads="R", shard="S1")


def _block(graph: OpGraph, fqn: str) -> bool:
    """A module holding weight modules (not a weight module, not a parameter-free dropout)."""
    mod = graph.model.get_submodule(fqn)
    return not is_weight_leaf(mod) and any(True for _ in mod.parameters())


def received_once(graph: OpGraph, value: int) -> bool:
    """``value`` enters a representative block whose folded copies receive other values in
    its place (the residual stream: the first block takes the embeddings, each later one the
    block before's output): a cut there is made once, on the representative only, and the
    copies' inputs arrive as the cut leaves it."""
    cached = graph.strategy_cache.setdefault("received once", {})
    if value not in cached:
        cached[value] = any(_other_at_copies(graph, m, value) for m in received_values(graph).get(value, ()))
    return cached[value]


def _other_at_copies(graph: OpGraph, module: str, value: int) -> bool:
    rep = graph.traced.calls[module][0]
    keys = [k for k, n in [*enumerate(rep.args), *rep.kwargs.items()] if _value_of(n) == value]
    copies = [op.node for op in graph.ops if op.kind == "folded" and graph.traced.folded.get(op.target) == module]
    return any(_value_of(c.args[k] if isinstance(k, int) and k < len(c.args) else c.kwargs.get(k)) != value
               for c in copies for k in keys)


def _value_of(node: Any) -> int | None:
    return getattr(node, "meta", {}).get("shardplan_op") if hasattr(node, "meta") else None


def inner_cut_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    """Twins of ``op``'s strategies that read a whole value made in its module's own code
    (no gradient, no module receiving it) and cut it there. Not under the export front end,
    whose ops are ATen's, not the calls the module's code makes."""
    if (op.kind != "function" or not op.owner or graph.traced.front_end == "export" or metadata_only(op)
            or _holds_layers(graph, op.owner) or _between_layers(graph, op.owner)):
        return []
    entries = slice_entries(graph)
    slots = []
    for i, v in enumerate(op.inputs):
        made = graph.ops[graph.values[v].producer] if v in graph.values else None
        if (made is None or made.kind == "input" or v in graph.requires_grad or not _inside(place(made), op.owner)
                or any(_inside(op.owner, m) for m in entries.get(v, ()))):
            continue
        slots.append(i)
    return entry_twins(strategies, slots, reads="R", arrow="~")


def _between_layers(graph: OpGraph, fqn: str) -> bool:
    """``fqn`` runs outside every layer of a model that has a stack of them (Hugging Face's
    ``model.rotary_emb``, called once before the layers): its output reaches every layer, and
    a cut made there (the positions along the sequence) would hand each layer shards of a
    value the layer's own plan reads whole; a bias made there is cut where each layer
    receives it (:func:`slice_twins`)."""
    layers = _stack_layers(graph)
    return bool(layers) and not any(_inside(fqn, layer) for layer in layers)


def _stack_layers(graph: OpGraph) -> tuple[str, ...]:
    """The children of every ``ModuleList`` (or the like) that are blocks, not weight leaves."""
    layers = graph.strategy_cache.get("stack layers")
    if layers is None:
        containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
        layers = graph.strategy_cache["stack layers"] = tuple(
            f"{name}.{child}" if name else child for name, m in graph.model.named_modules()
            if isinstance(m, containers) for child, c in m.named_children()
            if any(True for _ in c.parameters()) and not is_weight_leaf(c))  # a block, not to_out's Linear
    return layers


def _holds_layers(graph: OpGraph, fqn: str) -> bool:
    """``fqn`` holds layers of a stack (children of a ``ModuleList`` or the like): the code
    between them (MPT's model body making the ALiBi bias for every block) is checked around
    the blocks, not run as one with them, so a cut there could not be found; the bias is cut
    where each block receives it instead."""
    return any(_inside(layer, fqn) and layer != fqn for layer in _stack_layers(graph))


def inner_cuts(graph: OpGraph, chosen: dict[int, Strategy]) -> dict[str, list[InnerCut]]:
    """The module whose code makes each call -> the inner cuts the chosen strategies make
    there, in trace order."""
    out: dict[str, list[InnerCut]] = {}
    for op in graph.ops:
        s = chosen.get(op.index)
        for slot, entry in enumerate(s.entry if s is not None else ()):
            if is_inner_cut(entry):
                out.setdefault(op.owner, []).append(InnerCut(op.index, slot, _INNER.fullmatch(entry).group(1)))
    return out


def entry_twins(strategies: list[Strategy], slots: list[int], *, reads: str, arrow: str = ">",
                folded: bool = False, shard: str | None = None) -> list[Strategy]:
    """For each strategy that reads input ``i`` (in ``slots``) as ``Shard(d)``, a twin that
    reads it ``reads`` (``R``: a whole value cut; ``P``: a partial sum reduce-scattered) with
    the entry ``{reads}{arrow}S{d}`` that makes it the shard there (``>``: where a module
    receives it or, a partial sum, returns it; ``^``: a whole value where its module returns it).
    ``folded``: a folded ``S{d}p{k}`` read qualifies too (a whole value cut needs no collective
    whatever blocks it is cut in). ``shard``: the pattern of the reads that qualify instead."""
    shard = re.compile(shard or (r"S\d+(?:p\d+)?" if folded else r"S\d+"))
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
        modules = received_values(graph).get(value, ())
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
