"""Local sizes: what a module's code must be told to run on one rank's shards.

Contract
--------
``find_local_attributes(graph, plan, placements, fqn, mesh=None)`` is called when the local
check (:mod:`.localcheck`) fails inside ``fqn``. It returns ``(attributes, local_views)``
for the plan, or None: the fewest integer attributes of ``fqn`` set to their local value
(``self.num_heads / tp``), else the views that spell a width read off a whole tensor
(:mod:`.localviews`), alone and then beside each set of attributes. Each candidate is proven
by running the check again and by every view of ``fqn``'s own code giving the local shape
the plan expects of it; nothing is written that the check did not pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..analyze.graph import OpGraph
from ..analyze.values import nonzero_at_upper_bound
from ..decide.folded import parts_of
from ..decide.placements import groups_of, index_items, local_shape, one_slice, shard_dim, tail_of
from ..decide.propagation import quiet_probes
from ..decide.slices import InnerCut
from ..plan.model import CutFix, LengthFix, LocalAttributes, LocalViews, Plan, SliceFix, ViewFix, int_attributes
from .emit import shard
from .localcheck import (
    LocalShapeError, _ViewRecorder, _check_mesh, _expected_views, _local_args, _meta_copy, _sub_plan, _targets,
    _scalar_truths, _scalars, _track_modules, _view_ops, check_local_shapes, cut_on_entry, handed_placement, stand_in_for,
)
from .localviews import CUT_FUNCTIONS, FACTORIES, WholeRead, discover_fixes, factory_sizes, read_cut

__all__ = ["find_local_attributes"]

_MAX_ATTRIBUTE_CANDIDATES = 12
_MAX_ATTRIBUTE_TRIALS = 64  # smallest sets first: every subset of up to 6 candidates


def _dim_sizes(graph: OpGraph, placements: dict[int, str], fqn: str, tp: int) -> tuple[dict[int, int], set[int]]:
    """Inside ``fqn``, the sizes of the dims the plan splits, each with the number of parts
    it is split into (tp; a kv-grouped dim's group count; the repeat of grouped kv heads
    ``tp / groups``), and the sizes of the other dims of those values."""
    split: dict[int, int] = {}
    whole: set[int] = set()
    for op in graph.ops:
        p = placements.get(op.output, "R") if op.output is not None else "R"
        d = shard_dim(p)
        if d is None or tail_of(p) or not (op.owner == fqn or op.owner.startswith(fqn + ".")):
            continue  # a whole tail's dim is not cut in equal parts: its cut pieces say how
        shape = graph.values[op.output].shape
        kind, n = groups_of(p) or ("", tp)
        parts = {d: n, d + 1: tp // n} if kind == "e" else {d: n}
        split.update((shape[i], k) for i, k in parts.items())
        blocks = parts_of(p)
        if blocks > 1 and d < len(shape) - 1 and shape[d] % blocks == 0:
            # heads folded into the batch (fairseq's ``view(-1, bsz * self.num_heads, head_dim)``,
            # ``[b * heads, ...]``): the count split is each block's heads, not the dim's size
            split[shape[d] // blocks] = tp
        whole.update(size for i, size in enumerate(shape) if i not in parts)
        src = groups_of(placements.get(op.inputs[0], "R")) if op.target == "repeat_interleave" and op.inputs else None
        repeats = op.node.args[1] if len(op.node.args) > 1 else op.node.kwargs.get("repeats")
        if src and src[0] == "g" and isinstance(repeats, int):
            split[repeats] = tp // src[1]  # x.repeat_interleave(g, dim): each rank repeats its kv head g / (tp / n) times
    return split, whole


def find_local_attributes(graph: OpGraph, plan: Plan, placements: dict[int, str], fqn: str, *, mesh: Any = None,
                          cuts: Sequence[InnerCut] = ()) -> tuple[list[LocalAttributes], list[LocalViews]] | None:
    """The fewest integer attributes of ``fqn`` that, set to their local value, let its shards
    run (``self.num_heads`` / tp; with kv heads in groups, ``self.n_kv_heads`` / groups and
    ``self.n_rep`` / (tp / groups)): the smallest sets first, each proven by running the
    check again and by every view having its planned local shape. Where none does (the code
    reads a width off a whole tensor: nanoGPT's ``view(B, T, C)``), the views that fail are
    fixed (:mod:`.localviews`), alone and then beside each set. ``cuts``: whole values the
    plan cuts inside ``fqn``'s code (:func:`~shardplan.decide.slices.inner_cuts`); each
    candidate must find every one of them still whole where it is read (ALiBi slopes made
    from a head count made local would run, on the wrong slopes). None when nothing is found."""
    from itertools import chain, islice

    names = _rule_names(graph, fqn)
    candidates, ints, split = _attribute_candidates(graph, placements, fqn, plan.tp)
    reads = _whole_reads(graph, cuts, plan.tp)

    def attributes(subset: tuple[str, ...]) -> list[LocalAttributes]:
        values = {k: ints[k] // split[ints[k]] for k in subset}
        why = _attribute_why(ints, values, split, plan.tp)
        return [LocalAttributes(module=n, values=values, why=why) for n in names] if subset else []

    for subset in islice(_subsets(candidates) if not reads else (), _MAX_ATTRIBUTE_TRIALS):
        if _passes(graph, plan.model_copy(update={"attributes": plan.attributes + attributes(subset)}), placements, fqn, mesh):
            return attributes(subset), []
    for subset in islice(chain([()], _subsets(candidates)), _MAX_ATTRIBUTE_TRIALS):
        trial = plan.model_copy(update={"attributes": plan.attributes + attributes(subset)})
        fixes, cut_fixes, slices, lengths = _discover_views(graph, trial, placements, fqn, mesh, reads)
        if len(slices) != len(reads):
            continue
        why = _views_why(fixes, cut_fixes, slices, lengths)
        views = [LocalViews(module=n, fixes=fixes, cuts=cut_fixes, slices=slices, lengths=lengths, why=why)
                 for n in names] if fixes or cut_fixes or slices or lengths else []
        if views and _passes(graph, trial.model_copy(update={"local_views": plan.local_views + views}), placements, fqn, mesh):
            return attributes(subset), views
    return None


def _whole_reads(graph: OpGraph, cuts: Sequence[InnerCut], tp: int) -> list[WholeRead]:
    """The calls that read a whole value the plan cuts there, as the trace recorded them."""
    out = []
    for c in cuts:
        op = graph.ops[c.op]
        shape = graph.values[op.inputs[c.slot]].shape
        out.append(WholeRead(function=op.target.strip("_"), input=c.slot, shape=tuple(shape), dim=shard_dim(c.target), parts=tp))
    return out


def _rule_names(graph: OpGraph, fqn: str) -> list[str]:
    from ..decide.assemble import pattern_map, patterned

    return patterned(fqn, graph, pattern_map(graph))


def _subsets(candidates: list[str]) -> Iterator[tuple[str, ...]]:
    from itertools import combinations

    return (sub for size in range(1, len(candidates) + 1) for sub in combinations(candidates, size))


def _attribute_candidates(graph: OpGraph, placements: dict[int, str], fqn: str,
                          tp: int) -> tuple[list[str], dict[str, int], dict[int, int]]:
    """The integer attributes to try, in order; every integer attribute; each split size's parts."""
    ints = int_attributes(graph.model.get_submodule(fqn))
    split, whole = _dim_sizes(graph, placements, fqn, tp)
    # a count the plan splits (heads: the sharded dim of the viewed q); first those that are
    # never a size it keeps whole (head_dim: rewriting it instead would also run, on wrong
    # heads), then those that also are one (2 kv heads beside a batch of 2, 16 heads of 16),
    # for which the view check alone decides; the module's own before its config's and its
    # children's
    counts = sorted((k for k, v in ints.items() if v in split and v % split[v] == 0),
                    key=lambda k: (k.startswith("config."), "." in k, k))
    clean = [k for k in counts if ints[k] not in whole]
    return (clean + [k for k in counts if k not in clean])[:_MAX_ATTRIBUTE_CANDIDATES], ints, split


def _passes(graph: OpGraph, trial: Plan, placements: dict[int, str], fqn: str, mesh: Any) -> bool:
    try:
        check_local_shapes(graph, trial, placements, mesh=mesh)
    except LocalShapeError as exc:
        if exc.module in (fqn, None):  # None: the check could not judge the shards, so they did not pass
            return False
    return _views_as_planned(graph, trial, placements, fqn, mesh)


def _discover_views(graph: OpGraph, plan: Plan, placements: dict[int, str], fqn: str, mesh: Any,
                    reads: list[WholeRead]) -> tuple[list[ViewFix], list[CutFix], list[SliceFix], list[LengthFix]]:
    """Run ``fqn``'s shards under ``plan`` and match each view that fails to the next local
    shape the plan expects of ``fqn``'s own views, and each cut (split, narrow, slice) to
    the numbers the plan expects of the trace's cut in the same place
    (:func:`.localviews.discover_fixes`); what ran is what was found, and the check judges
    the rest."""
    expected = _expected_views(graph, placements, fqn, plan.tp).get(fqn, [])
    cuts = _expected_cuts(graph, placements, fqn, plan.tp)
    found: list[tuple[list[ViewFix], list[CutFix], list[SliceFix], list[LengthFix]]] = []
    seq_parts = plan.tp if _reads_sequence_shards(graph, placements, fqn, plan) else None
    seq_expected = [local_shape(graph.values[op.output].shape, placements.get(op.output, "R"), plan.tp)
                    for op in _view_ops(graph, placements, fqn, plan.tp) if op.owner == fqn] if seq_parts else []
    seq_cuts = _traced_cuts(graph, fqn) if seq_parts else []
    seq_made = _traced_factories(graph, fqn) if seq_parts else []

    def prepare(block: nn.Module, inner: str) -> contextlib.AbstractContextManager:
        found.append(discover_fixes(block.get_submodule(inner), expected, cuts, reads, seq_parts=seq_parts,
                                    seq_expected=seq_expected, seq_cuts=seq_cuts, seq_made=seq_made))
        return contextlib.nullcontext()

    if expected or seq_expected or reads or any(c is not None for c in cuts):
        _run_view_target(graph, plan, placements, fqn, mesh, prepare)
    return found[0] if found else ([], [], [], [])


def _traced_cuts(graph: OpGraph, fqn: str) -> list[list[int] | None]:
    """The numbers of each cut under ``fqn`` as the trace made them (whole lengths), in the
    order :func:`_expected_cuts` counts them; None for one whose numbers cannot be scaled."""
    out: list[list[int] | None] = []
    for op, name in _cut_ops(graph, fqn):
        cut = read_cut(name, tuple(op.node.args[1:]), dict(op.node.kwargs))
        if cut is not None:
            out.append(list(cut.numbers) if cut.scalable else None)
    return out


def _traced_factories(graph: OpGraph, fqn: str) -> list[tuple[str, list[int]]]:
    """The factory calls of ``fqn``'s own code as the trace made them: name, integer sizes."""
    out = []
    for op in graph.ops:
        if op.kind == "function" and op.owner == fqn and op.target in FACTORIES and not op.inputs:
            sizes, _ = factory_sizes(op.target, tuple(op.node.args))
            out.append((op.target, sizes))
    return out


def _reads_sequence_shards(graph: OpGraph, placements: dict[int, str], fqn: str, plan: Plan) -> bool:
    """``fqn`` is handed an activation on sequence shards (``S(1)`` of a 3-d or larger
    value), or cuts one onto them where it receives it: a length its code reads off it
    (``B, T, C = x.shape``) is 1/tp of the sequence."""
    calls = graph.traced.calls.get(graph.traced.folded.get(fqn, fqn)) or []
    cut = cut_on_entry(graph, plan, fqn)
    for call in calls[:1]:
        for node in list(call.args) + list(call.kwargs.values()):
            v = getattr(node, "meta", {}).get("shardplan_op")
            # as the block is handed it (a value cut onto sequence shards where a module before
            # it returns), or as its own entry cuts it
            if v in graph.values and len(graph.values[v].shape) >= 3 and shard_dim(
                    cut.get(v) or handed_placement(placements, v, fqn)) == 1:
                return True
    return False


def _expected_cuts(graph: OpGraph, placements: dict[int, str], fqn: str, tp: int) -> list[Any]:
    """For each cut the code under ``fqn`` makes, in trace order (the same calls
    :func:`.localviews.read_cut` counts at run time): its numbers as the plan expects them on
    a shard, where the plan splits the cut dim (``split(C)`` of a packed q/k/v -> ``C /
    tp``), else None (nothing to fix)."""
    out: list[Any] = []
    for op, name in _cut_ops(graph, fqn):
        cut = read_cut(name, tuple(op.node.args[1:]), dict(op.node.kwargs))
        if cut is not None:
            out.append(_local_numbers(graph, op, name, cut, placements, tp) if cut.fixable else None)
    return out


def _cut_ops(graph: OpGraph, fqn: str) -> list[tuple[Any, str]]:
    """The ops under ``fqn`` that may be cuts, each with the name the run-time mode sees."""
    out = []
    for op in graph.ops:
        if op.kind != "function" or not (op.owner == fqn or op.owner.startswith(fqn + ".")) or not op.inputs:
            continue
        name = "__getitem__" if op.target == "getitem" else op.target
        if name in CUT_FUNCTIONS:
            out.append((op, name))
    return out


def _local_numbers(graph: OpGraph, op: Any, name: str, cut: Any, placements: dict[int, str], tp: int) -> Any:
    """The cut's numbers divided by the shards of the dim it cuts (None when that dim is whole)."""
    shape = graph.values[op.inputs[0]].shape
    dim = _cut_dim(name, op, len(shape))
    if dim is None:
        return None
    if tail_of(placements.get(op.inputs[0], "R")):
        return None  # a whole tail's dim is not cut in equal parts: sizes made local say how
    local = local_shape(shape, placements.get(op.inputs[0], "R"), tp)[dim]
    if local in (0, shape[dim]) or shape[dim] % local:
        return None
    factor = shape[dim] // local
    return [n // factor for n in cut.numbers] if all(n % factor == 0 for n in cut.numbers) else None


def _cut_dim(name: str, op: Any, ndim: int) -> int | None:
    args, kwargs = op.node.args, op.node.kwargs
    if name == "split":
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    elif name == "narrow":
        dim = args[1]
    else:
        cut = one_slice(args[1])
        if cut is None:
            return None
        items = index_items(args[1], ndim)
        at = next(i for i, it in enumerate(items) if it is cut)
        dim = at - sum(1 for it in items[:at] if it is None)
    return dim % ndim if isinstance(dim, int) else None


def _views_why(fixes: list[ViewFix], cuts: list[CutFix], slices: list[SliceFix] = (),
               lengths: list[LengthFix] = ()) -> str:
    dims = ", ".join([_fix_said(f) for f in fixes] + [
        f"cut {c.call} x {c.seq_parts}" if c.seq_parts else f"cut {c.call} / {c.parts}" for c in cuts] + [
        f"{f.function} call {f.call} sizes {f.args} x {f.parts}" for f in lengths])
    said = [f"its code sizes views by a width read off a whole tensor; on a shard: {dims}"] if dims else []
    if any(f.seq_dim is not None for f in fixes) or any(c.seq_parts for c in cuts) or lengths:
        said.append("and by a length read off its sequence-split input, which the gathered tensors hold whole")
    if slices:
        calls = ", ".join(f"{f.function} call {f.call} input {f.input} dim {f.dim}" for f in slices)
        said.append(f"its code makes a whole value read beside split ones, cut to this rank's part where read: {calls}")
    return "; ".join(said)


def _fix_said(f: ViewFix) -> str:
    if f.seq_dim is None:
        return f"dim {f.dim} / {f.parts}"
    return f"view {f.call}: dim {f.seq_dim} x {f.seq_parts}" + (f", dim {f.dim} / {f.parts}" if f.parts > 1 else "")


def _attribute_why(ints: dict[str, int], values: dict[str, int], split: dict[int, int], tp: int) -> str:
    changes = ", ".join(f"{k} {ints[k]} -> {v}" for k, v in values.items())
    shard = "a 1/tp shard" if all(split[ints[k]] == tp for k in values) else "one rank's shard"
    return f"its code sizes tensors by them: {changes} on {shard}"




def _views_as_planned(graph: OpGraph, plan: Plan, placements: dict[int, str], fqn: str, mesh: Any) -> bool:
    """Running is not enough: with ``dim`` halved instead of ``heads``, ``view(b, s,
    self.heads, self.dim // self.heads)`` runs too, on heads of half the width. Every view
    the module's code makes must give the local shape the plan expects of that value (its
    global shape with the sharded dim / tp), in the order the tracer recorded them (views of
    constants the tracer folded away may come between)."""
    expected = [local_shape(graph.values[op.output].shape, placements.get(op.output, "R"), plan.tp)
                for op in _view_ops(graph, placements, fqn, plan.tp)]
    try:
        seen = iter(_record_views(graph, plan, placements, fqn, mesh))
    except Exception:  # noqa: BLE001 - it ran in the check; any failure here is a refusal
        return False
    # in order, allowing views the trace folded into constants (a RoPE cache's slice)
    return all(any(shape == want for shape in seen) for want in expected)


def _view_target(graph: OpGraph, fqn: str) -> str:
    """The module to run for ``fqn``'s views, keeping those made inside ``fqn``: the block the
    check runs that holds it, so its inputs arrive as the plan hands them (gathered by a
    region at their producer's output: a parallel block's shared norm), else the nearest
    module whose call was recorded (fqn itself, or, under the export front end, which
    records the root's call only, the whole model)."""
    for t in sorted(_targets(graph), key=len, reverse=True):
        if (not t or fqn == t or fqn.startswith(t + ".")) and t in graph.traced.calls:
            return t
    target = fqn
    while target not in graph.traced.calls and target:
        target = target.rpartition(".")[0]
    return target


def _record_views(graph: OpGraph, plan: Plan, placements: dict[int, str], fqn: str, mesh: Any) -> list[tuple[int, ...]]:
    """The output shapes of the views ``fqn``'s own code makes (not its weight modules'),
    running its shards under ``plan``."""
    views: list[tuple[str, tuple[int, ...]]] = []
    _run_view_target(graph, plan, placements, fqn, mesh,
                     lambda block, _inner: _ViewRecorder(block, _track_modules(block, prepend=True), views))
    inner = fqn[len(_view_target(graph, fqn)):].lstrip(".")
    return [shape for name, shape in views if not inner or name == inner or name.startswith(inner + ".")]


def _run_view_target(graph: OpGraph, plan: Plan, placements: dict[int, str], fqn: str, mesh: Any,
                     prepare: Callable[[nn.Module, str], contextlib.AbstractContextManager]) -> None:
    """A meta copy of the block that holds ``fqn`` (:func:`_view_target`), sharded by
    ``plan``, run once on its example inputs as the plan hands them, inside ``prepare(block,
    fqn relative to the block)``. A failure ends the run: a module after ``fqn`` failing (the
    decoder's cross-attention, not fixed yet) leaves ``fqn``'s views recorded, a failure
    inside ``fqn`` leaves some missing, which refuses."""
    target = _view_target(graph, fqn)
    call = graph.traced.calls[target][0]
    with _check_mesh(plan, mesh) as tp_mesh:
        if tp_mesh is None:
            return
        block = shard(_meta_copy(graph.model.get_submodule(target)), tp_mesh, _sub_plan(plan, target))
        stand_in_for(block, graph, plan, placements, target)
        args, kwargs = _local_args(call, placements, plan.tp, target)
        with contextlib.suppress(Exception), torch.no_grad(), quiet_probes(), nonzero_at_upper_bound(), \
                prepare(block, fqn[len(target):].lstrip(".")), _scalars(_scalar_truths(graph), target):
            block(*args, **kwargs)
