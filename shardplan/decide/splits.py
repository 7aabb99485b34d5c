"""Splits: which dp x tp mesh of ``world_size`` devices to train on.

Contract
--------
``dp_tp_splits(world_size)`` lists ``{"dp": world_size // tp, "tp": tp}`` for every divisor
``tp`` of ``world_size``, smallest tp first; ``ep_splits(world_size, experts)`` adds, for a
model with expert banks of ``experts`` experts, ``{"dp": ..., "ep": ep, "tp": tp}`` with the
largest ep that divides both the experts and ``world_size // tp`` (an ep rank is a data
rank for everything but its experts). A :class:`MeshCandidate` holds one split's plan
(or why it has none) and whether its predicted peak memory fits; :func:`choose` picks the
candidate with the most samples per second among those that fit. Each data-parallel replica
runs its own batch (``batch_size`` is per replica, as everywhere in shardplan), so a step of
``dp=8,tp=8`` trains 8 batches and one of ``dp=1,tp=64`` one batch: splits are compared on
``dp * batch / step_time_s``, not on step time, which would favour the split that does the
least work. ``api.compare_meshes`` plans the candidates; this module only compares them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..plan.model import Plan
from .cost import format_bytes

__all__ = ["MeshCandidate", "MeshComparison", "dp_tp_splits", "ep_splits", "data_ranks", "choose", "axes_str"]


def dp_tp_splits(world_size: int) -> list[dict[str, int]]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of devices), got {world_size!r}; "
                         "e.g. world_size=64")
    return [{"dp": world_size // tp, "tp": tp} for tp in range(1, world_size + 1) if world_size % tp == 0]


def ep_splits(world_size: int, experts: int | None) -> list[dict[str, int]]:
    if not experts:
        return []
    out = []
    for split in dp_tp_splits(world_size):
        ep = math.gcd(experts, split["dp"])
        if ep > 1:
            out.append({"dp": split["dp"] // ep, "ep": ep, "tp": split["tp"]})
    return out


def data_ranks(axes: Mapping[str, int]) -> int:
    """Ranks that each run their own batch: every axis but tp."""
    return math.prod(n for axis, n in axes.items() if axis != "tp")


def axes_str(axes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


@dataclass(frozen=True)
class MeshCandidate:
    """One dp x tp split: its plan (planned without explanations), or why it has none."""

    axes: dict[str, int]
    plan: Plan | None
    error: str = ""
    fits: bool = False  # predicted peak memory within the comparison's limit

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over all devices: each data rank (dp, and ep) runs its own batch."""
        if self.plan is None or self.plan.estimate is None or self.plan.estimate.step_time_s <= 0:
            return None
        return data_ranks(self.axes) * (self.plan.options.batch_size or 1) / self.plan.estimate.step_time_s


def choose(candidates: list[MeshCandidate]) -> int | None:
    """Index of the fitting candidate with the most samples per second; among equals the
    smaller tp (listed first: fewer collectives on the critical path). None if none fits."""
    fitting = [i for i, c in enumerate(candidates) if c.fits and c.samples_per_s is not None]
    return max(fitting, key=lambda i: (candidates[i].samples_per_s, -i), default=None)


@dataclass(frozen=True)
class MeshComparison:
    """Every candidate split, smallest tp first, and the chosen one."""

    world_size: int
    memory_limit: int  # bytes per device a candidate's predicted peak must not exceed
    limit_source: str  # where the limit comes from: "memory budget", or "h100-nvlink's device memory"
    candidates: list[MeshCandidate] = field(default_factory=list)
    chosen: int | None = None  # index into candidates
    plan_of_chosen: Plan | None = None  # with explanations when they were asked for

    @property
    def plan(self) -> Plan:
        """The chosen split's plan; ``PlanningError`` when no split fits."""
        if self.plan_of_chosen is None:
            from .solve import PlanningError  # torch comes with it: file-only commands read this module

            raise PlanningError(self.no_fit_message())
        return self.plan_of_chosen

    def no_fit_message(self) -> str:
        planned = [c for c in self.candidates if c.plan is not None and c.plan.estimate is not None]
        if not planned:
            first = self.candidates[0]
            return (f"no dp x tp split of {self.world_size} devices has a plan (each candidate's error says why; "
                    f"`shardplan plan --world-size` lists them): {axes_str(first.axes)}: "
                    f"{(first.error.splitlines() or [''])[0]}")
        low = min(planned, key=lambda c: c.plan.estimate.peak_memory_bytes)
        return (f"no dp x tp split of {self.world_size} devices fits the {format_bytes(self.memory_limit)} per device "
                f"({self.limit_source}): the smallest predicted peak is "
                f"{format_bytes(low.plan.estimate.peak_memory_bytes)} at {axes_str(low.axes)}; lower the batch or "
                "sequence, use a lighter optimizer, or plan for more devices")
