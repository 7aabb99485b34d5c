"""Local views: a module's views that spell a global width, sized for one rank's shard.

Contract
--------
``install_local_views(model, plan)`` makes each module of ``plan.local_views`` apply its
fixes while its forward runs (a ``TorchFunctionMode`` entered by a forward pre-hook and left
by an ``always_call`` forward hook, so an exception leaves no mode behind): the ``k``-th
``view``/``reshape`` whose explicit sizes hold ``parts`` times its tensor's elements gets
dim ``fixes[k].dim`` divided by ``parts``. A view that fits, or one with a ``-1``, runs as
written. ``discover_fixes(module, expected)`` is the planner's side: run under it, each
failing view is matched to the next planned local shape in ``expected`` that it equals with
one dim divided, and the fixes are recorded (the local check then proves the plan).

Why it is needed: nanoGPT's attention reads ``B, T, C = x.size()`` off its whole input and
ends with ``y.transpose(1, 2).contiguous().view(B, T, C)``. On a rank, ``y`` holds its
``H / tp`` heads, ``C / tp`` features, and no integer attribute holds ``C`` for
:class:`~shardplan.plan.model.LocalAttributes` to make local.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..plan.model import Plan, SplitFix, ViewFix, expand_pattern

__all__ = ["install_local_views", "discover_fixes", "VIEW_FUNCTIONS"]

VIEW_FUNCTIONS = frozenset({"view", "reshape"})

# (index among the failing views, requested sizes, elements held) -> the fix, or None
Chooser = Callable[[int, list[int], int], "ViewFix | None"]
# (index among the module's splits, requested sizes, size of the split dim) -> parts, or None
SplitChooser = Callable[[int, "int | list[int]", int], "int | None"]


class _FixViews(TorchFunctionMode):
    def __init__(self, choose: Chooser, choose_split: SplitChooser) -> None:
        super().__init__()
        self.choose, self.choose_split = choose, choose_split
        self.failing = self.splits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "split" and args and isinstance(args[0], torch.Tensor):
            return self._split(func, args, kwargs)
        if name in VIEW_FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            sizes = _sizes(args[1:])
            if sizes is not None and -1 not in sizes and math.prod(sizes) != args[0].numel():
                fix = self.choose(self.failing, sizes, args[0].numel())
                self.failing += 1
                if fix is not None and fix.dim < len(sizes) and sizes[fix.dim] % fix.parts == 0:
                    sizes[fix.dim] //= fix.parts
                    return func(args[0], sizes, **kwargs)
        return func(*args, **kwargs)

    def _split(self, func, args: tuple, kwargs: dict):
        """``x.split(C, dim)`` / ``torch.split(x, [a, b], dim)``: every call is counted (a
        split by a global width runs, on fewer parts, so it cannot be told by failing), and
        the one the plan names gets its sizes divided."""
        rest = dict(kwargs)
        sizes = args[1] if len(args) > 1 else rest.pop("split_size", rest.pop("split_size_or_sections", None))
        dim = args[2] if len(args) > 2 else rest.pop("dim", 0)
        if not isinstance(dim, int) or not _split_sizes(sizes):
            return func(*args, **kwargs)
        parts = self.choose_split(self.splits, sizes, args[0].shape[dim])
        self.splits += 1
        divided = _divided(sizes, parts) if parts else None
        return func(*args, **kwargs) if divided is None else func(args[0], divided, dim, **rest)


def _split_sizes(sizes: Any) -> bool:
    return isinstance(sizes, int) or (isinstance(sizes, (list, tuple)) and bool(sizes)
                                      and all(isinstance(s, int) for s in sizes))


def _divided(sizes: int | list[int], parts: int) -> int | list[int] | None:
    """``sizes`` / ``parts`` when every size divides, else None (run as written)."""
    each = [sizes] if isinstance(sizes, int) else list(sizes)
    if any(s % parts for s in each):
        return None
    return sizes // parts if isinstance(sizes, int) else [s // parts for s in each]


def _sizes(rest: tuple) -> list[int] | None:
    """The sizes of ``x.view(a, b)``, ``x.view((a, b))`` or ``torch.reshape(x, (a, b))``."""
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = tuple(rest[0])
    return [int(s) for s in rest] if rest and all(isinstance(s, int) for s in rest) else None


def _run_with(module: nn.Module, choose: Chooser, choose_split: SplitChooser) -> None:
    """Enter a fresh mode for every call of ``module``'s forward and leave it after."""
    live: list[_FixViews] = []

    def enter(_m, _args):
        live.append(_FixViews(choose, choose_split))
        live[-1].__enter__()

    def leave(_m, _args, _out):
        live.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def install_local_views(model: nn.Module, plan: Plan) -> None:
    for entry in plan.local_views:
        fixes, splits = list(entry.fixes), {s.call: s.parts for s in entry.splits}
        for fqn in expand_pattern(entry.module, plan.model.repeats):
            _run_with(model.get_submodule(fqn), lambda k, _s, _n, f=fixes: f[k] if k < len(f) else None,
                      lambda k, _s, _n, p=splits: p.get(k))


def discover_fixes(module: nn.Module, expected: list[tuple[int, ...]],
                   expected_splits: list[Any] = ()) -> tuple[list[ViewFix], list[SplitFix]]:
    """Install the planner's chooser on ``module`` (run it afterwards); the returned lists
    fill in as its failing views are matched to ``expected``, in order, and as its k-th
    split asks ``parts`` times the chunk ``expected_splits[k]`` holds (the trace's splits
    under the module, in order)."""
    found: list[ViewFix] = []
    found_splits: list[SplitFix] = []
    cursor = [0]

    def choose(k: int, sizes: list[int], numel: int) -> ViewFix | None:
        for i in range(cursor[0], len(expected)):
            fix = _one_dim_divided(sizes, expected[i], numel)
            if fix is not None:
                cursor[0] = i + 1
                found.append(fix)
                return fix
        return None

    def choose_split(k: int, sizes: int | list[int], _size: int) -> int | None:
        want = expected_splits[k] if k < len(expected_splits) else None
        parts = _split_parts(sizes, want) if want is not None else None
        if parts is not None:
            found_splits.append(SplitFix(call=k, parts=parts))
        return parts

    _run_with(module, choose, choose_split)
    return found, found_splits


def _split_parts(sizes: int | list[int], want: int | list[int]) -> int | None:
    """The one factor ``parts >= 2`` with every asked size ``parts`` times the planned one."""
    got = [sizes] if isinstance(sizes, int) else list(sizes)
    wanted = [want] if isinstance(want, int) else list(want)
    if len(got) != len(wanted) or not all(w > 0 and g % w == 0 for g, w in zip(got, wanted)):
        return None
    ratios = {g // w for g, w in zip(got, wanted)}
    parts = ratios.pop() if len(ratios) == 1 else 1
    return parts if parts >= 2 else None


def _one_dim_divided(sizes: list[int], want: tuple[int, ...], numel: int) -> ViewFix | None:
    if len(sizes) != len(want) or math.prod(want) != numel:
        return None
    differ = [d for d, (a, b) in enumerate(zip(sizes, want)) if a != b]
    if len(differ) != 1 or sizes[differ[0]] % want[differ[0]]:
        return None
    parts = sizes[differ[0]] // want[differ[0]]
    return ViewFix(dim=differ[0], parts=parts) if parts >= 2 else None
