"""FSDP units and their collectives: what ``fully_shard`` on the data axes wraps, and what it costs.

Contract
--------
``fsdp_units(repeats, model, *, reshard_after_forward="default")`` lists the FSDP units as
``(module path, reshard_after_forward)`` in the order ``fully_shard`` must be called
(innermost first, the root ``""`` last). :func:`shardplan.apply.fsdp.fully_shard_plan` wraps
exactly these, and :func:`shardplan.decide.estimate.estimate` prices exactly these, so the two
cannot drift. ``data_parallel_events(unit_bytes, data_axes, links, mode=...)`` lists the
collectives one training step issues on the data axes, each with the group and link it runs
over. Pure functions of the model's module tree and plain numbers: no process group.

The units follow torchtitan's ``apply_fsdp``: one unit per repeated block (every child of each
outermost ``ModuleList`` / ``ModuleDict`` / ``Sequential`` that owns parameters), the root last
with everything else (embeddings, final norm, head). torchtitan does not reshard the unit that
runs last in forward, since backward needs it at once; here that is the last block (the root is
never resharded: FSDP2 keeps a root's parameters after forward for the same reason). A block
whose parameter is also owned by a module outside it (a tied weight) is not wrapped on its own:
its parameters stay in the root's unit, so one all-gather serves both owners.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from . import cost

__all__ = ["RESHARD_POLICIES", "DataParallelEvent", "fsdp_units", "data_parallel_events", "unit_of"]

RESHARD_POLICIES = ("default", "always", "never")
ReshardPolicy = Literal["default", "always", "never"]


def fsdp_units(
    repeats: Mapping[str, int | list[str]], model: nn.Module, *, reshard_after_forward: ReshardPolicy = "default"
) -> list[tuple[str, bool]]:
    """``[(block path, reshard_after_forward), ..., ("", False)]``; see the module docstring."""
    if reshard_after_forward not in RESHARD_POLICIES:
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is not a policy; expected one of "
                         f"{', '.join(RESHARD_POLICIES)} (torchtitan's names)")
    owners = _param_owners(model)
    blocks = [b for b in _blocks(repeats, model) if not _shares_outside(owners, b)]
    reshard = reshard_after_forward != "never"
    units = [(b, reshard) for b in blocks]
    if units and reshard_after_forward == "default":  # the last block runs first in backward
        units[-1] = (units[-1][0], False)
    return units + [("", False)]


def _blocks(repeats: Mapping[str, int | list[str]], model: nn.Module) -> list[str]:
    """Children of the outermost containers that own parameters, in container order."""
    containers = [c for c in repeats if c]
    outer = [c for c in containers if not any(c.startswith(o + ".") for o in containers if o != c)]
    out = []
    for c in outer:
        names = repeats[c]
        for name in [str(i) for i in range(names)] if isinstance(names, int) else names:
            path = f"{c}.{name}"
            if next(model.get_submodule(path).parameters(), None) is not None:
                out.append(path)
    return out


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every module FQN that registers it (a tied weight has two)."""
    owners: dict[int, list[str]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(fqn)
    return owners


def _shares_outside(owners: dict[int, list[str]], block: str) -> bool:
    """Whether a parameter of ``block`` is also registered on a module outside it: one pass
    over the model's modules for all blocks, not one per block."""
    inside = lambda fqn: fqn == block or fqn.startswith(block + ".")  # noqa: E731
    return any(any(inside(f) for f in fqns) and not all(inside(f) for f in fqns) for fqns in owners.values() if len(fqns) > 1)


def unit_of(module: str, units: list[tuple[str, bool]]) -> str:
    """The unit whose ``fully_shard`` call owns ``module``'s parameters: the block that
    contains it, else the root ``""``."""
    return next((u for u, _ in units if u and (module == u or module.startswith(u + "."))), "")


@dataclass(frozen=True)
class DataParallelEvent:
    kind: str  # a cost.COLLECTIVES name
    nbytes: float  # logical bytes, as cost.collective_time takes them
    times: int  # per step
    group_size: int
    link: cost.Link


def data_parallel_events(
    unit_bytes: list[tuple[float, bool]], data_axes: Mapping[str, int], links: Mapping[str, cost.Link], *,
    mode: Literal["fsdp", "ddp"],
) -> list[DataParallelEvent]:
    """The collectives of one step over the data axes.

    ``unit_bytes`` is ``(local parameter bytes at the tp shard, reshard_after_forward)`` per
    unit. FSDP (the last data axis shards; a first axis replicates, HSDP): per unit with
    parameters, one all-gather in forward, one more in backward if resharded, one
    reduce-scatter of its gradients, and under HSDP one all-reduce of the reduce-scattered
    shard over the replicate axis. More than two data axes: all but the last replicate, their
    ring on the slowest of their links. DDP: one all-reduce of every gradient over all data axes.
    """
    sizes = [n for n in data_axes.values()]
    if not sizes or _prod(sizes) == 1:
        return []
    if mode == "ddp":
        total = sum(b for b, _ in unit_bytes)
        return [DataParallelEvent("all_reduce", total, 1, _prod(sizes), _slowest(links, list(data_axes)))]
    *replicate_axes, shard_axis = list(data_axes)
    shard, replicate = data_axes[shard_axis], _prod([data_axes[a] for a in replicate_axes])
    events = []
    for nbytes, reshard in unit_bytes:
        if nbytes <= 0:
            continue  # FSDP issues nothing for a unit that manages no parameters
        link = links[shard_axis]
        events += [DataParallelEvent("all_gather", nbytes, 1 + reshard, shard, link),
                   DataParallelEvent("reduce_scatter", nbytes, 1, shard, link)]
        if replicate > 1:
            events.append(DataParallelEvent("all_reduce", nbytes / shard, 1, replicate, _slowest(links, replicate_axes)))
    return events


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _slowest(links: Mapping[str, cost.Link], axes: list[str]) -> cost.Link:
    return min((links[a] for a in axes), key=lambda link: (link.bandwidth, -link.alpha_s))
