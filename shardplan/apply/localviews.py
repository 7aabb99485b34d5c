"""Local views: a module's views that spell a global width, sized for one rank's shard.

Contract
--------
``install_local_views(model, plan)`` makes each module of ``plan.local_views`` apply its
fixes while its forward runs (a ``TorchFunctionMode`` entered by a forward pre-hook and left
by an ``always_call`` forward hook, so an exception leaves no mode behind): the ``k``-th
``view``/``reshape`` whose explicit sizes hold ``parts`` times its tensor's elements gets
dim ``fixes[k].dim`` divided by ``parts``. A view that fits, or one with a ``-1``, runs as
written. Every cut (``split``, ``narrow``, a slice with a number for a bound) is counted,
and the ``call``-th one ``cuts`` names gets its numbers divided by ``parts``.
A :class:`~shardplan.plan.model.SliceFix` names the ``call``-th call of a function (counted
by name) whose whole tensor argument is cut to this rank's part: a value the module's own
code makes and reads beside split ones (ALiBi slopes from ``self.n_heads``).
``discover_fixes(module, expected, expected_cuts, expected_slices)`` is the planner's side:
run under it, each failing view is matched to the next planned local shape in ``expected``
that it equals with one dim divided, each cut to the local numbers the plan expects of the
trace's cut in the same place, each call reading a whole value the plan cuts
(:class:`WholeRead`) by its function and the value's whole shape, and the fixes are recorded
(the local check then proves the plan).

Why it is needed: nanoGPT's attention reads ``B, T, C = x.size()`` off its whole input and
ends with ``y.transpose(1, 2).contiguous().view(B, T, C)``; a user's block cuts its fused
q/k/v with ``qkv(x).split(C, dim=-1)`` or ``qkv[..., :C]``. On a rank, ``y`` holds its
``H / tp`` heads, ``C / tp`` features, the packed q/k/v ``3 C / tp``, and no integer
attribute holds ``C`` for :class:`~shardplan.plan.model.LocalAttributes` to make local.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..plan.model import CutFix, LengthFix, Plan, SliceFix, ViewFix, expand_pattern

__all__ = ["install_local_views", "discover_fixes", "read_cut", "factory_sizes", "WholeRead", "VIEW_FUNCTIONS",
           "CUT_FUNCTIONS", "FACTORIES"]

VIEW_FUNCTIONS = frozenset({"view", "reshape"})

# (index among the failing views, requested sizes, elements held) -> the fix, or None
Chooser = Callable[[int, list[int], int], "ViewFix | None"]
# (index among all the views, requested sizes, elements held) -> a fix by a length read off a
# sequence shard (:class:`ViewFix` with ``seq_dim``), or None
SeqChooser = Callable[[int, list[int], int], "ViewFix | None"]
# (index among the module's cuts, the cut's numbers, whether one bounded slice) -> the fix, or None
CutChooser = Callable[[int, list[int], bool], "CutFix | None"]
# (factory, index among its calls, its integer sizes) -> the fix, or None
LengthChooser = Callable[[str, int, list[int]], "LengthFix | None"]
# (function, index among its calls, its tensor arguments) -> (argument, dim, parts) to cut, or None
SliceChooser = Callable[[str, int, list[torch.Tensor]], "tuple[int, int, int] | None"]


class _FixViews(TorchFunctionMode):
    def __init__(self, choose: Chooser, choose_cut: CutChooser, choose_slice: SliceChooser | None = None,
                 rank: int = 0, choose_seq: SeqChooser | None = None, choose_length: LengthChooser | None = None,
                 own_file: str | None = None) -> None:
        super().__init__()
        self.choose, self.choose_cut, self.choose_slice, self.rank = choose, choose_cut, choose_slice, rank
        self.choose_seq, self.choose_length, self.own_file = choose_seq, choose_length, own_file
        self.failing = self.cuts = self.views = 0
        self.calls: dict[str, int] = {}
        self.made: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = _caller_file()
        if caller is not None and caller.startswith(_TORCH_DISTRIBUTED):
            # DTensor's own code (a redistribute's ``narrow`` that unpads a gathered tensor, made
            # only at some lengths), not the module's: neither counted nor fixed, so the counts
            # are the code's own at every length
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.choose_length is not None and name in FACTORIES:
            args = self._length(name, args)
        if self.choose_slice is not None:
            args, kwargs = self._slice(name.strip("_"), args, kwargs)
        if name in CUT_FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            cut = read_cut(name, args[1:], kwargs)
            if cut is not None:
                return self._cut(func, args, kwargs, cut)
        if name in VIEW_FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            sizes = _sizes(args[1:])
            # counted where the module's own file makes them: a library helper's views may differ
            # by device (transformers' sdpa repeats kv heads on meta, not on CPU)
            if sizes is not None and self.choose_seq is not None and caller == self.own_file:
                self.views += 1
                fix = self.choose_seq(self.views - 1, sizes, args[0].numel())
                rescaled = rescale(sizes, fix) if fix is not None else None
                if rescaled is not None:
                    return func(args[0], rescaled, **kwargs)
            if sizes is not None and -1 not in sizes and math.prod(sizes) != args[0].numel():
                fix = self.choose(self.failing, sizes, args[0].numel())
                self.failing += 1
                if fix is not None and fix.dim < len(sizes) and sizes[fix.dim] % fix.parts == 0:
                    sizes[fix.dim] //= fix.parts
                    return func(args[0], sizes, **kwargs)
        return func(*args, **kwargs)

    def _slice(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every call is counted by its function; the one a :class:`SliceFix` names gets its
        whole tensor argument cut to this rank's part (rank order, equal parts)."""
        k = self.calls[name] = self.calls.get(name, -1) + 1
        tensors = _tensor_args(args, kwargs)
        found = self.choose_slice(name, k, [a for _, _, a in tensors])
        if found is None:
            return args, kwargs
        slot, dim, parts = found
        where, key, x = tensors[slot]
        if x.shape[dim] % parts:
            raise ValueError(f"{name} call {k}: its input {slot} of shape {tuple(x.shape)} cannot be cut in {parts} "
                             f"equal parts on dim {dim}, as the plan cuts it; plan again for these inputs")
        width = x.shape[dim] // parts
        x = x.narrow(dim, self.rank * width, width)
        if where == "args":
            return args[:key] + (x,) + args[key + 1:], kwargs
        return args, {**kwargs, key: x}

    def _length(self, name: str, args: tuple) -> tuple:
        """Every factory call is counted by its function; the one a :class:`LengthFix` names
        gets the sizes it lists multiplied."""
        k = self.made[name] = self.made.get(name, -1) + 1
        sizes, rebuild = factory_sizes(name, args)
        fix = self.choose_length(name, k, sizes) if sizes else None
        if fix is None or max(fix.args) >= len(sizes):
            return args
        return rebuild([n * fix.parts if i in fix.args else n for i, n in enumerate(sizes)])

    def _cut(self, func, args: tuple, kwargs: dict, cut: "Cut"):
        """Every cut is counted (one by a global width runs, on other parts, so it cannot be
        told by failing), and the one the plan names gets its numbers divided (a width read
        off a whole tensor) or multiplied (a length read off a sequence shard)."""
        fix = self.choose_cut(self.cuts, cut.numbers, cut.fixable) if cut.scalable else None
        self.cuts += 1
        if fix is None:
            return func(*args, **kwargs)
        if fix.seq_parts is not None:
            return func(args[0], *cut.rebuild([n * fix.seq_parts for n in cut.numbers]), **cut.rest)
        if not cut.fixable or any(n % fix.parts for n in cut.numbers):
            return func(*args, **kwargs)
        return func(args[0], *cut.rebuild([n // fix.parts for n in cut.numbers]), **cut.rest)


_TORCH_DISTRIBUTED = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
# torch's Python entry points a call of the module's code passes through before the mode sees it
_WRAPPERS = frozenset(os.path.join(os.path.dirname(torch.__file__), f) for f in ("overrides.py", "_tensor.py", "functional.py"))


def _caller_file() -> str | None:
    """The file of the code that made the call the mode sees."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename in _WRAPPERS or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else None


# Cuts by a width: ``x.split(C, dim)`` / ``torch.split(x, [a, b], dim)`` (the sizes),
# ``x.narrow(dim, start, length)`` (start and length), ``x[..., a:b]`` (the bounds of its one
# slice with a number in it). Their numbers are what a width read off a whole tensor makes
# global; on a shard of that dim each is 1/parts of it.
CUT_FUNCTIONS = frozenset({"split", "narrow", "__getitem__"})


@dataclass(frozen=True)
class Cut:
    numbers: list[int]
    rebuild: Callable[[list[int]], tuple]
    rest: dict
    fixable: bool = True  # its numbers may be divided: a split, a narrow, one bounded slice of step 1
    scalable: bool = True  # its numbers may be multiplied: every bounded slice of step 1


# Factories a module's code makes a tensor with from sizes it read (``torch.ones(T, T)``,
# ``torch.arange(T)``): the sizes, a tuple first argument or the leading integers
FACTORIES = frozenset({"ones", "zeros", "empty", "full", "arange", "rand", "randn", "tril_indices", "triu_indices"})


def factory_sizes(name: str, args: tuple) -> tuple[list[int], Callable[[list[int]], tuple]]:
    """A factory call's integer sizes and how to call it with others: ``ones((a, b), ...)``
    or ``ones(a, b, ...)``; ``arange(end)``, ``arange(start, end[, step])``."""
    if args and isinstance(args[0], (tuple, list, torch.Size)):
        sizes = list(args[0])
        if all(_is_int(n) for n in sizes):
            return sizes, lambda n, a=args: (type(a[0])(n) if not isinstance(a[0], torch.Size) else tuple(n),) + a[1:]
        return [], lambda n: args
    lead = 0
    while lead < len(args) and _is_int(args[lead]) and not (name == "full" and lead > 0 and lead == len(args) - 1):
        lead += 1
    if name == "arange" and lead == 3:
        lead = 2  # the step is no length
    return list(args[:lead]), lambda n, a=args, k=lead: tuple(n) + a[k:]


def _is_int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


def read_cut(name: str, rest: tuple, kwargs: dict) -> Cut | None:
    """The numbers of a cut, called as ``name(x, *rest, **kwargs)``; None when it is no cut."""
    if name == "split":
        kw = dict(kwargs)
        sizes = rest[0] if rest else kw.pop("split_size", kw.pop("split_size_or_sections", None))
        dim = rest[1] if len(rest) > 1 else kw.pop("dim", 0)
        if not isinstance(dim, int) or not _split_sizes(sizes):
            return None
        numbers = [sizes] if isinstance(sizes, int) else list(sizes)
        return Cut(numbers, lambda n, one=isinstance(sizes, int), d=dim: (n[0] if one else n, d), kw)
    if name == "narrow":
        if len(rest) == 3 and not kwargs and all(isinstance(v, int) for v in rest):
            return Cut([rest[1], rest[2]], lambda n, d=rest[0]: (d, n[0], n[1]), {})
        return None
    return _read_slice(rest[0]) if len(rest) == 1 and not kwargs else None


def _read_slice(index: Any) -> Cut | None:
    """``x[..., a:b]``: a cut when a slice of the index has a number for a bound; fixable when
    exactly one does and its step is 1."""
    items = list(index) if isinstance(index, tuple) else [index]
    bounded = [i for i, it in enumerate(items) if isinstance(it, slice)
               and any(isinstance(b, int) and not isinstance(b, bool) for b in (it.start, it.stop))]
    if not bounded:
        return None
    plain = all(items[i].step in (None, 1) and all(b is None or isinstance(b, int) for b in (items[i].start, items[i].stop))
                for i in bounded)
    numbers = [b for i in bounded for b in (items[i].start, items[i].stop) if isinstance(b, int)]

    def rebuild(n: list[int]) -> tuple:
        it = iter(n)
        new = list(items)
        for i in bounded:
            sl = items[i]
            bounds = [next(it) if isinstance(b, int) else b for b in (sl.start, sl.stop)]
            new[i] = slice(bounds[0], bounds[1], sl.step)
        return (tuple(new) if isinstance(index, tuple) else new[0],)

    return Cut(numbers, rebuild, {}, fixable=plain and len(bounded) == 1, scalable=plain)


def _sizes(rest: tuple) -> list[int] | None:
    """The sizes of ``x.view(a, b)``, ``x.view((a, b))`` or ``torch.reshape(x, (a, b))``."""
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = tuple(rest[0])
    return [int(s) for s in rest] if rest and all(isinstance(s, int) for s in rest) else None


def _tensor_args(args: tuple, kwargs: dict) -> list[tuple[str, Any, torch.Tensor]]:
    """The tensor arguments of a call in the tracer's order (positional, then keyword), with
    where each sits: ``("args", i)`` or ``("kwargs", name)``."""
    found = [("args", i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return found + [("kwargs", k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]


def rescale(sizes: list[int], fix: ViewFix) -> list[int] | None:
    """The sizes a fix by a length read off a sequence shard asks for: ``seq_dim`` times
    ``seq_parts`` (the whole sequence the gathered tensor holds), ``dim`` divided by
    ``parts`` unless the code left it to ``-1``; None when they do not divide."""
    out = list(sizes)
    if fix.seq_dim >= len(out) or out[fix.seq_dim] < 0 or fix.dim >= len(out):
        return None
    out[fix.seq_dim] *= fix.seq_parts
    if fix.parts > 1 and out[fix.dim] != -1:
        if out[fix.dim] % fix.parts:
            return None
        out[fix.dim] //= fix.parts
    return out


def _run_with(module: nn.Module, choose: Chooser, choose_cut: CutChooser, choose_slice: SliceChooser | None = None,
              rank: int = 0, choose_seq: SeqChooser | None = None, choose_length: LengthChooser | None = None) -> None:
    """Enter a fresh mode for every call of ``module``'s forward and leave it after."""
    live: list[_FixViews] = []

    own_file = _source_file(module)

    def enter(_m, _args):
        live.append(_FixViews(choose, choose_cut, choose_slice, rank, choose_seq, choose_length, own_file))
        live[-1].__enter__()

    def leave(_m, _args, _out):
        live.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _source_file(module: nn.Module) -> str | None:
    try:
        return inspect.getsourcefile(type(module))
    except TypeError:
        return None


def install_local_views(model: nn.Module, plan: Plan, *, rank: int = 0) -> None:
    """``rank``: this rank's coordinate on the tp axis, which a :class:`SliceFix` cuts by."""
    for entry in plan.local_views:
        fixes = [f for f in entry.fixes if f.seq_dim is None]
        by_call = {f.call: f for f in entry.fixes if f.seq_dim is not None}
        cuts = {c.call: c for c in entry.cuts}
        slices = {(f.function, f.call): (f.input, f.dim, f.parts) for f in entry.slices}
        lengths = {(f.function, f.call): f for f in entry.lengths}
        choose_slice = (lambda name, k, _t, s=slices: s.get((name, k))) if slices else None
        choose_seq = (lambda k, _s, _n, f=by_call: f.get(k)) if by_call else None
        choose_length = (lambda name, k, _s, f=lengths: f.get((name, k))) if lengths else None
        for fqn in expand_pattern(entry.module, plan.model.repeats):
            _run_with(model.get_submodule(fqn), lambda k, _s, _n, f=fixes: f[k] if k < len(f) else None,
                      lambda k, _n, _one, p=cuts: p.get(k), choose_slice, rank, choose_seq, choose_length)


@dataclass(frozen=True)
class WholeRead:
    """A cut the plan makes inside a module's code, as the trace recorded it: the call of
    ``function`` whose ``input``-th tensor argument has the whole ``shape``, cut on ``dim``."""

    function: str
    input: int
    shape: tuple[int, ...]
    dim: int
    parts: int


def discover_fixes(module: nn.Module, expected: list[tuple[int, ...]], expected_cuts: list[Any] = (),
                   expected_slices: list[WholeRead] = (), *, seq_parts: int | None = None,
                   seq_expected: list[tuple[int, ...]] = (), seq_cuts: list[list[int] | None] = (),
                   seq_made: list[tuple[str, list[int]]] = (),
                   ) -> tuple[list[ViewFix], list[CutFix], list[SliceFix], list[LengthFix]]:
    """Install the planner's chooser on ``module`` (run it afterwards); the returned lists
    fill in as its failing views are matched to ``expected``, in order, as its k-th cut
    asks ``parts`` times the numbers ``expected_cuts[k]`` (the trace's cuts under the
    module, in order, as the plan expects them locally; None: nothing to fix) holds, and as
    a call reads a tensor of the whole shape the next of ``expected_slices`` names (in trace
    order) where it names it. ``seq_parts``: the module reads a sequence-split input (its
    ``T`` is the whole length / ``seq_parts``); every view is then matched to the next of
    ``seq_expected`` (the local shapes of all the module's own views, split or whole), a view
    sized by that ``T`` regrouping a gathered tensor's rows without failing; every cut to the
    trace's numbers of the same cut (``seq_cuts``, None where it is no cut to scale), and
    every factory call to the next trace call of that factory (``seq_made``: its name and
    integer sizes), ``seq_parts`` times what the code asked."""
    found: list[ViewFix] = []
    found_cuts: list[CutFix] = []
    found_slices: list[SliceFix] = []
    found_lengths: list[LengthFix] = []
    made_cursor = [0]
    next_slice = [0]

    def choose_slice(name: str, k: int, tensors: list[torch.Tensor]) -> tuple[int, int, int] | None:
        if next_slice[0] >= len(expected_slices):
            return None
        want = expected_slices[next_slice[0]]
        if name != want.function or want.input >= len(tensors) or tuple(tensors[want.input].shape) != want.shape:
            return None
        next_slice[0] += 1
        found_slices.append(SliceFix(function=name, call=k, input=want.input, dim=want.dim, parts=want.parts))
        return want.input, want.dim, want.parts

    choose = _next_match(expected, found, lambda k, sizes, want, numel: _one_dim_divided(sizes, want, numel))
    choose_seq = _next_match(seq_expected, found, lambda k, sizes, want, numel: _sequence_rescaled(
        k, sizes, want, numel, seq_parts))

    def choose_cut(k: int, numbers: list[int], one: bool) -> CutFix | None:
        want = expected_cuts[k] if k < len(expected_cuts) and one else None
        parts = _cut_parts(numbers, want) if want is not None else None
        whole = seq_cuts[k] if seq_parts and k < len(seq_cuts) else None
        fix = CutFix(call=k, parts=parts) if parts is not None else (
            CutFix(call=k, parts=1, seq_parts=seq_parts) if whole is not None and _scaled(numbers, whole, seq_parts) else None)
        if fix is not None:
            found_cuts.append(fix)
        return fix

    def choose_length(name: str, k: int, sizes: list[int]) -> LengthFix | None:
        for i in range(made_cursor[0], len(seq_made)):
            function, whole = seq_made[i]
            if function == name and len(whole) == len(sizes):
                made_cursor[0] = i + 1
                short = [j for j, (a, b) in enumerate(zip(sizes, whole)) if a != b]
                if short and all(sizes[j] * seq_parts == whole[j] for j in short):
                    found_lengths.append(LengthFix(function=name, call=k, args=short, parts=seq_parts))
                    return found_lengths[-1]
                return None
        return None

    _run_with(module, choose, choose_cut, choose_slice if expected_slices else None,
              choose_seq=choose_seq if seq_parts else None, choose_length=choose_length if seq_made else None)
    return found, found_cuts, found_slices, found_lengths


def _next_match(shapes: list[tuple[int, ...]], found: list[ViewFix],
                match: Callable[[int, list[int], tuple[int, ...], int], ViewFix | None]) -> Chooser:
    """A chooser that matches each view it is asked about to the next of ``shapes`` (from
    where the last match left off) that ``match`` fixes it to, recording the fix."""
    cursor = [0]

    def choose(k: int, sizes: list[int], numel: int) -> ViewFix | None:
        for i in range(cursor[0], len(shapes)):
            fix = match(k, sizes, shapes[i], numel)
            if fix is not None:
                cursor[0] = i + 1
                found.append(fix)
                return fix
        return None

    return choose


def _scaled(got: list[int], whole: list[int], parts: int) -> bool:
    """Every number of the cut ``parts`` times short of the trace's (some of them not 0)."""
    return len(got) == len(whole) and got != whole and all(g * parts == w for g, w in zip(got, whole))


def _cut_parts(got: list[int], want: list[int]) -> int | None:
    """The one factor ``parts >= 2`` with every asked number ``parts`` times the planned one."""
    if len(got) != len(want) or any(g % w if w else g for g, w in zip(got, want)):
        return None
    ratios = {g // w for g, w in zip(got, want) if w}
    parts = ratios.pop() if len(ratios) == 1 else 1
    return parts if parts >= 2 else None


def _split_sizes(sizes: Any) -> bool:
    return isinstance(sizes, int) or (isinstance(sizes, (list, tuple)) and bool(sizes)
                                      and all(isinstance(s, int) for s in sizes))


def _one_dim_divided(sizes: list[int], want: tuple[int, ...], numel: int) -> ViewFix | None:
    if len(sizes) != len(want) or math.prod(want) != numel:
        return None
    differ = [d for d, (a, b) in enumerate(zip(sizes, want)) if a != b]
    if len(differ) != 1 or sizes[differ[0]] % want[differ[0]]:
        return None
    parts = sizes[differ[0]] // want[differ[0]]
    return ViewFix(dim=differ[0], parts=parts) if parts >= 2 else None


def _sequence_rescaled(call: int, sizes: list[int], want: tuple[int, ...], numel: int, seq_parts: int) -> ViewFix | None:
    """``sizes`` spell ``want`` but for one dim ``seq_parts`` times too short (the length read
    off a sequence shard) and at most one other ``parts`` times too long (a global width) or
    left to ``-1``; ``want`` holds the tensor's elements."""
    if len(sizes) != len(want) or math.prod(want) != numel:
        return None
    short = [d for d, (a, b) in enumerate(zip(sizes, want)) if a > 0 and a * seq_parts == b]
    rest = [d for d, (a, b) in enumerate(zip(sizes, want)) if a != b and d not in short]
    if len(short) != 1 or len(rest) > 1:
        return None
    if not rest:
        return ViewFix(dim=short[0], parts=1, call=call, seq_dim=short[0], seq_parts=seq_parts)
    d = rest[0]
    if sizes[d] == -1:
        return ViewFix(dim=d, parts=1, call=call, seq_dim=short[0], seq_parts=seq_parts)
    if sizes[d] <= 0 or sizes[d] % want[d] or sizes[d] // want[d] < 2:
        return None
    return ViewFix(dim=d, parts=sizes[d] // want[d], call=call, seq_dim=short[0], seq_parts=seq_parts)
