"""Regions: where one PrepareModuleInput lets several Linears share one collective.

Contract
--------
``find_regions(graph, solution)`` returns, for every value that enters sharded computation
(``entry`` in a chosen strategy), how the emitter realizes the entry:

* a :class:`RegionSite`: the innermost module that receives the value as an argument and
  contains every consumer of it, all of which enter there. ``PrepareModuleInput(...,
  use_local_output=False)`` on that module turns the value into a DTensor once, so the
  Partial gradients of, say, wq, wk and wv add up as DTensors and one all-reduce (or one
  reduce-scatter under sequence parallel) closes the region in backward;
* a sequence-sharded value is gathered at the outermost such module, even for one consumer
  (a fused ``wqkv``): the module's own code then reads the whole sequence, as it does
  unsharded (``bs, seqlen, _ = x.shape`` before its view by heads);
* otherwise each consumer's own style converts the value: one collective per consumer.

Only data flow and module boundaries decide; module names never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analyze.graph import LIKE_OPS, Op, OpGraph
from .propagation import metadata_only
from .scatter import exits, is_cut, is_gather, is_scatter
from .slices import is_inner_cut, is_slice, place
from ..plan.model import Region
from .solve import Solution
from .strategies import placement_str

__all__ = ["RegionSite", "Entry", "PartialBlock", "Handover", "find_regions", "find_partial_blocks", "find_handovers",
           "handover_regions"]


@dataclass(frozen=True)
class RegionSite:
    module: str
    input: int | str | None  # None: the module's output is the value (PrepareModuleOutput)
    num_inputs: int


@dataclass(frozen=True)
class Entry:
    value: int
    kind: str  # "R", "S{d}", or "R>S{d}" (a whole value cut where a module receives it)
    consumers: tuple[int, ...]  # op indices
    sites: tuple[tuple[RegionSite, tuple[int, ...]], ...]  # region module -> consumers inside

    @property
    def num_collectives(self) -> int:
        """One per region, plus one per consumer that converts its input on its own; a
        slice none (Replicate -> Shard is local)."""
        if is_slice(self.kind):
            return 0
        if is_gather(self.kind):
            return len(self.sites)
        if is_scatter(self.kind) or is_cut(self.kind):  # one PrepareModuleOutput where the module returns
            return len(self.sites)
        grouped = sum(len(c) for _, c in self.sites)
        return len(self.sites) + len(self.consumers) - grouped

    def gradient_collectives(self, reached: frozenset[int] | set[int]) -> int:
        """The collectives that sum this value's gradient in backward: as
        :attr:`num_collectives`, counting only regions and consumers a gradient comes back
        through (``reached``: op indices; DeepSeek V3.2's indexer reads the layer's input for
        top-k indices only, so its projections hand back none)."""
        if is_slice(self.kind) or is_gather(self.kind) or is_scatter(self.kind) or is_cut(self.kind):
            return self.num_collectives
        grouped = {c for _, cs in self.sites for c in cs}
        sites = sum(1 for _, cs in self.sites if any(c in reached for c in cs))
        return sites + sum(1 for c in self.consumers if c not in grouped and c in reached)


def _inside(fqn: str, module: str) -> bool:
    return module == "" or fqn == module or fqn.startswith(module + ".")


def _entering_consumers(graph: OpGraph, solution: Solution, value: int, kind: str) -> tuple[int, ...]:
    found = []
    for c in graph.consumers.get(value, []):
        s = solution.strategies[c]
        for slot, v in enumerate(graph.ops[c].inputs):
            if v == value and slot < len(s.entry) and s.entry[slot] == kind:
                found.append(c)
    return tuple(sorted(set(found)))


def _candidate_sites(graph: OpGraph, value: int, consumers: tuple[int, ...], *,
                     fewest: int = 2) -> list[tuple[RegionSite, tuple[int, ...]]]:
    """Modules that receive ``value`` as an argument and hold only entering consumers of it,
    at least ``fewest`` of them."""
    node = graph.ops[graph.values[value].producer].node
    # a read of metadata (``x.device`` for a mask, ``w.type_as(x)``) is the same on the gathered value
    others = {c for c in graph.consumers.get(value, []) if not metadata_only(graph.ops[c])
              and not _dtype_source(graph.ops[c], value)} - set(consumers)
    found = []
    for fqn, calls in graph.traced.calls.items():
        if not fqn or fqn in graph.traced.folded or len(calls) != 1:
            continue
        call = calls[0]
        where: int | str | None = next((i for i, a in enumerate(call.args) if a is node), None)
        if where is None:
            where = next((k for k, a in call.kwargs.items() if a is node), None)
        inside = tuple(c for c in consumers if _inside(place(graph.ops[c]), fqn))
        if where is None or len(inside) < fewest or (len(inside) == 1 and graph.ops[inside[0]].target == fqn):
            continue  # one consumer that is the module itself: its own style converts the input
        if any(_inside(graph.ops[o].owner, fqn) or _inside(graph.ops[o].target, fqn) for o in others):
            continue
        found.append((RegionSite(fqn, where, len(call.args)), inside))
    return found


def _dtype_source(op: Op, value: int) -> bool:
    """``w.type_as(x)``, ``w.to(x)``: ``x`` read for its dtype and device only (Mixtral's
    routing weights ``softmax(...).type_as(inputs)``)."""
    return op.target in LIKE_OPS and value in op.inputs[1:] and op.inputs[0] != value


def _output_site(graph: OpGraph, value: int, consumers: tuple[int, ...]):
    """The module that produces ``value``, when every consumer of it enters sharded compute:
    ``PrepareModuleOutput(..., use_local_output=False)`` there hands all of them one DTensor,
    e.g. a norm feeding attention and MLP branches side by side (GPT-J)."""
    producer = graph.ops[graph.values[value].producer]
    if producer.kind != "module" or len(consumers) < 2 or len(graph.traced.calls.get(producer.target, [])) != 1:
        return None
    readers = {c for c in graph.consumers.get(value, []) if not metadata_only(graph.ops[c])}  # its size aside
    if readers != set(consumers) or not isinstance(producer.node.meta.get("val"), torch.Tensor):
        return None
    return (RegionSite(producer.target, None, 0), consumers)


def _choose_sites(candidates, consumers: tuple[int, ...], output_site=None, *, outermost: bool = False):
    """Fewest collectives: modules covering most consumers first, then the innermost (the
    outermost for a sequence-sharded value); a producer's output region when it beats the
    input regions."""
    chosen, left = [], set(consumers)
    depth = (lambda m: len(m)) if outermost else (lambda m: -len(m))  # nested modules: a longer name is inside
    for site, inside in sorted(candidates, key=lambda c: (-len(c[1]), depth(c[0].module), c[0].module)):
        if set(inside) <= left:
            chosen.append((site, inside))
            left -= set(inside)
    if output_site is not None and len(chosen) + len(left) > 1:
        return (output_site,)
    return tuple(sorted(chosen, key=lambda c: c[0].module))


def find_regions(graph: OpGraph, solution: Solution) -> list[Entry]:
    entries = []
    for (value, kind), used in sorted(solution.entries.items()):
        if not used:
            continue
        consumers = _entering_consumers(graph, solution, value, kind)
        if not consumers or is_inner_cut(kind):  # cut inside the module's code: a local view, no region
            continue
        sequence = kind.startswith("S")
        if is_gather(kind):  # gathered where the outermost module holding its readers receives it
            sites = _choose_sites(_candidate_sites(graph, value, consumers, fewest=1), consumers, outermost=True)
            own = graph.ops[consumers[0]]
            if not sites and len(consumers) == 1 and own.kind == "module":  # a norm gathering its own input
                slot = own.inputs.index(value)
                sites = ((RegionSite(own.target, slot, len(own.node.args)), consumers),)
            entries.append(Entry(value, kind, consumers, sites))
            continue
        if is_scatter(kind) or is_cut(kind):  # converted where the module that computes it returns
            site = RegionSite(exits(graph)[value].module, None, 0)
            entries.append(Entry(value, kind, consumers, ((site, consumers),)))
            continue
        if is_slice(kind):  # cut where the module receives it: the innermost module holding every reader
            sites = _choose_sites(_candidate_sites(graph, value, consumers, fewest=1), consumers)
            if sum(len(c) for _, c in sites) != len(consumers):
                raise AssertionError(f"a slice of value {value} has readers outside any module that receives it")
            entries.append(Entry(value, kind, consumers, sites))
            continue
        sites = _choose_sites(
            _candidate_sites(graph, value, consumers, fewest=1 if sequence else 2), consumers,
            _output_site(graph, value, consumers), outermost=sequence,
        )
        entries.append(Entry(value, kind, consumers, sites))
    return entries


@dataclass(frozen=True)
class PartialBlock:
    """A block whose output is its input plus several row-parallel branches (GPT-J:
    ``x + attn(ln(x)) + mlp(ln(x))``). The branches stay Partial DTensors, the residual
    enters as a Replicate DTensor (DTensor adds R + P as P without communication), and one
    all-reduce at the block's output replaces one per branch."""

    module: str
    input: int
    num_inputs: int
    rowwise: tuple[int, ...]  # op indices whose outputs stay Partial
    output: int  # value id of the block output


_ADD = {"add", "__add__", "iadd", "__radd__"}


def _sum_leaves(graph: OpGraph, value: int, fqn: str, root: bool) -> list[int] | None:
    """Values summed into ``value`` through two-operand adds inside ``fqn`` (each used once)."""
    op = graph.ops[graph.values[value].producer]
    single_use = len(graph.consumers.get(value, [])) == 1
    if op.target in _ADD and len(op.inputs) == 2 and _inside(op.owner, fqn) and (root or single_use):
        parts = [_sum_leaves(graph, v, fqn, False) for v in op.inputs]
        return None if any(p is None for p in parts) else parts[0] + parts[1]
    return [value]


def _partial_block(graph: OpGraph, solution: Solution, fqn: str, call) -> PartialBlock | None:
    if len(call.outputs) != 1 or "shardplan_op" not in call.outputs[0].meta:
        return None
    out = call.outputs[0].meta["shardplan_op"]
    leaves = _sum_leaves(graph, out, fqn, True)
    if not leaves:
        return None
    args = [a.meta["shardplan_op"] if a is not None else None for a in call.args]
    rowwise = [graph.values[v].producer for v in leaves if _is_rowwise_to_replicate(graph, solution, v)]
    residual = [v for v in leaves if graph.values[v].producer not in rowwise]
    if len(rowwise) < 2 or len(residual) != 1 or residual[0] not in args:
        return None
    x = residual[0]
    adds = {graph.values[v].producer for v in _add_values(graph, out, fqn)}
    if any(c not in adds and graph.ops[c].kind != "module" for c in graph.consumers.get(x, [])):
        return None  # the residual would reach a plain-tensor op as a DTensor
    return PartialBlock(fqn, args.index(x), len(call.args), tuple(sorted(rowwise)), out)


def _is_rowwise_to_replicate(graph: OpGraph, solution: Solution, value: int) -> bool:
    op = graph.ops[graph.values[value].producer]
    s = solution.strategies.get(op.index)
    return op.kind == "module" and s is not None and s.name == "rowwise" and s.output == "R" and len(graph.consumers.get(value, [])) == 1


def _add_values(graph: OpGraph, value: int, fqn: str) -> list[int]:
    op = graph.ops[graph.values[value].producer]
    if op.target in _ADD and _inside(op.owner, fqn):
        return [value] + [w for v in op.inputs for w in _add_values(graph, v, fqn)]
    return []


def find_partial_blocks(graph: OpGraph, solution: Solution) -> list[PartialBlock]:
    found = []
    for fqn, calls in sorted(graph.traced.calls.items()):
        if fqn and fqn not in graph.traced.folded and len(calls) == 1:
            block = _partial_block(graph, solution, fqn, calls[0])
            if block is not None:
                found.append(block)
    return found


def partial_grad_params(graph: OpGraph, solution: Solution) -> list[str]:
    """Trainable parameters a container reads in its own forward (a learned temperature),
    kept whole (``R``), that reach a computation split tp ways: each rank's gradient is the
    sum over its own shard, ``Partial``, so it is all-reduced once when backward ends, with
    the sequence-parallel norms' gradients (:mod:`shardplan.apply.gradsync`)."""
    from .strategies import param_only_values

    own = param_only_values(graph)
    out = []
    for op in graph.ops:
        if op.kind == "const" and op.output in own and solution.strategies[op.index].output == "R" \
                and _reaches_a_shard(graph, solution, op.output, own):
            out.append(op.target)
    return sorted(set(out))


def _reaches_a_shard(graph: OpGraph, solution: Solution, value: int, own: frozenset[int]) -> bool:
    stack, seen = [value], {value}
    while stack:
        v = stack.pop()
        for c in graph.consumers.get(v, []):
            s = solution.strategies[c]
            out = graph.ops[c].output
            # a weight module's style sums its own input's gradient (a colwise to_q on Perceiver's latents)
            if s.output is not None and s.output != "R" and graph.ops[c].kind != "module":
                return True
            if out is not None and out in own and out not in seen:
                seen.add(out)
                stack.append(out)
    return False


@dataclass(frozen=True)
class Handover:
    """A sharded value that the code between the blocks reads: kept a DTensor from the module
    that makes it to the block that takes it (``at``: that block's argument; None: the
    producing module's output)."""

    module: str
    at: int | str | None
    num_inputs: int
    placement: str  # "S1": the value's placement, the same on both sides
    read: bool = False  # an output the code after the blocks computes with (not one a block takes)


def find_handovers(graph: OpGraph, placements: dict[int, str], blocks: list[str]) -> list[Handover]:
    """Where sharded values cross from the code between ``blocks`` into them.

    Hugging Face's decoders read the embedding output's sizes for positions and the mask
    (``arange(inputs_embeds.shape[1])``); on a plain local tensor under sequence parallel that
    is s / tp. As a DTensor the same code reads the global sizes, and DTensor's own ops run
    what else it computes there (GPT-2's ``wte(x) + wpe(p)``, Gemma's scale). So each module
    outside the blocks whose sharded output reaches a block keeps it a DTensor
    (``PrepareModuleOutput``), and the block's entry turns it back into the local tensor its
    code is checked on (``PrepareModuleInput``, ``use_local_output``). Same placements on
    both sides: no collective."""
    out: dict[tuple, Handover] = {}
    # a block checked by its parts (a MoE layer's attention beside experts whose shapes were
    # assumed) still receives the value as the layer: the handover ends at the stack's layer
    stacks = set(graph.traced.folded) | set(graph.traced.folded.values())
    blocks = sorted({next((s for s in stacks if _inside(b, s) and s != ""), b) for b in blocks})
    for fqn in blocks:
        if fqn not in graph.traced.calls:
            continue  # a folded copy: its input is the block before it
        call = graph.traced.calls[fqn][0]
        handed = [(i, a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
        for at, node in handed:
            v = getattr(node, "meta", {}).get("shardplan_op") if hasattr(node, "meta") else None
            if v in graph.values and (p := placements.get(v, "R")).startswith("S"):
                producers = _outside_producers(graph, v, placements, blocks)
                for op in producers:
                    out[(op.target, None)] = Handover(op.target, None, len(op.node.args), placements[op.output])
                if producers:
                    out[(fqn, at)] = Handover(fqn, at, len(call.args), p)
    for op in _read_by_code_between(graph, placements, blocks):
        out.setdefault((op.target, None), Handover(op.target, None, len(op.node.args), placements[op.output], read=True))
    return sorted(out.values(), key=lambda h: (h.module, str(h.at)))


def _read_by_code_between(graph: OpGraph, placements: dict[int, str], blocks: list[str]) -> list:
    """Weight modules outside ``blocks`` whose sharded output the code between the blocks
    computes with (GPT-2 views its final norm's output by the input's sequence length)."""
    found = []
    for op in graph.ops:
        if op.kind != "module" or op.output is None or any(_inside(op.target, b) for b in blocks):
            continue
        if not placements.get(op.output, "R").startswith("S"):
            continue
        readers = [graph.ops[c] for c in graph.consumers.get(op.output, [])]
        if any(r.kind == "function" and not metadata_only(r) and not any(_inside(r.owner, b) for b in blocks)
               for r in readers):
            found.append(op)
    return found


def _outside_producers(graph: OpGraph, value: int, placements: dict[int, str], blocks: list[str]) -> list:
    """The weight modules outside ``blocks`` whose sharded outputs flow into ``value``
    through the code between the blocks, modules included (Bloom's embedding norm: the mask
    is made from the embedding's output before it)."""
    op = graph.ops[graph.values[value].producer]
    if any(_inside(place(op), b) for b in blocks) or not placements.get(value, "R").startswith("S"):
        return []
    if op.kind not in ("module", "function"):
        return []
    found = [p for v in op.inputs if v in graph.values for p in _outside_producers(graph, v, placements, blocks)]
    return found + [op] if op.kind == "module" else found


def handover_regions(handovers: list[Handover]) -> list[Region]:
    out = []
    for h in handovers:
        layout = placement_str(h.placement).replace("()", "")
        entry = h.at is not None
        out.append(Region(
            module=h.module, input=h.at if entry else "output", num_inputs=h.num_inputs, input_layouts=layout,
            desired_input_layouts=layout, use_local_output=entry,
            why=("its code is checked on local tensors: the DTensor handed to it becomes one here" if entry
                 else "handed on as a DTensor, so the code after it computes with global sizes (a view by the "
                      "input's length), not those of 1/tp of the sequence" if h.read
                 else "handed on as a DTensor, so the code between the blocks reads global sizes off it (positions, "
                      "the mask), not those of 1/tp of the sequence"),
        ))
    return out
