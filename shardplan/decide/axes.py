"""Axes: what each named axis of a device mesh is to the planner.

Contract
--------
``mesh_axes(mesh)`` reads axis sizes off a ``DeviceMesh`` or a mapping, validated.
``tp_axis_of(axes, requested)`` names the tensor-parallel axis (``tp``, else the one
non-data axis; the expert axis ``ep`` and an axis of a kind the planner does not model are
never taken for it), or None when the mesh has only data and expert axes (no tensor
parallelism: tp = 1). ``expert_axis`` names the ``ep`` axis, where expert banks are split by
whole experts. ``check_axes(axes, tp_axis)`` refuses any other axis that is not a data axis,
with what to do; ``state_shards`` says how many ranks split parameter, gradient and
optimizer state beyond tp (ep counts as a data axis there: every module but the experts
treats it as one). Names only: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DATA_AXES", "REPLICATE_AXES", "EXPERT_AXES", "UNMODELLED", "mesh_axes", "tp_axis_of", "expert_axis",
           "check_axes", "state_shards"]


def mesh_axes(mesh: Any) -> dict[str, int]:
    """Axis sizes from a DeviceMesh or a mapping, validated."""
    if isinstance(mesh, Mapping):
        axes = {str(k): v for k, v in mesh.items()}
    elif hasattr(mesh, "mesh_dim_names"):
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        axes = dict(zip(names, mesh.mesh.shape))
    else:
        raise ValueError(f"mesh must be a DeviceMesh or axis sizes like {{'tp': 8}}; got {type(mesh).__name__}")
    bad = {k: v for k, v in axes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if not axes or bad:
        raise ValueError(f"mesh axis sizes must be positive integers, e.g. {{'tp': 8}}; got {axes}")
    return {k: int(v) for k, v in axes.items()}


# Mesh axes the planner prices as data parallel: each holds a replica of the tp group's
# model working on its own batch. Under FSDP the last of them shards parameter, gradient and
# optimizer state and any before it replicate (HSDP: what fully_shard does on a 2-D mesh);
# ``dp_replicate`` (torchtitan's name for that outer axis) never shards, even alone (DDP).
DATA_AXES = ("dp", "dp_shard", "dp_replicate", "fsdp")
REPLICATE_AXES = ("dp_replicate",)
UNMODELLED = {  # axes people name in torchtitan-style meshes, and what to do instead
    "pp": ("pipeline parallelism", "plan one pipeline stage's module on the remaining axes"),
    "cp": ("context parallelism", "plan without it (activation memory is then that of the whole sequence)"),
}
# expert parallelism: banks split by whole experts, tokens dispatched by all-to-all (decide.experts)
EXPERT_AXES = ("ep",)


def tp_axis_of(axes: dict[str, int], requested: str | None) -> str | None:
    if requested is not None:
        if requested not in axes:
            raise ValueError(f"tp_axis {requested!r} is not a mesh axis; the mesh has {list(axes)}")
        return requested
    if "tp" in axes:
        return "tp"
    others = [name for name in axes if name not in DATA_AXES + EXPERT_AXES and name not in UNMODELLED]
    if not others and any(name in EXPERT_AXES for name in axes):
        return None  # {"ep": 8}, {"dp": 2, "ep": 4}: experts over ep, no tensor parallelism
    unmodelled = [name for name in axes if name in UNMODELLED and axes[name] > 1]
    if not others and unmodelled:  # {"ep": 8} is not a tensor-parallel axis by another name
        name = unmodelled[0]
        what, instead = UNMODELLED[name]
        raise ValueError(f"mesh axis {name!r} (size {axes[name]}) is {what}, which the planner does not model, and "
                         f"the mesh has no tensor-parallel axis; {instead} (e.g. {{'tp': {axes[name]}}}), or pass "
                         f"tp_axis={name!r} to plan tensor parallelism on it")
    others = others or [name for name in axes if name not in DATA_AXES]
    if not others:
        raise ValueError(f"mesh {axes} has no tensor-parallel axis, only data axes ({', '.join(DATA_AXES)}); add one, "
                         f"e.g. {({**axes, 'tp': 1})} for data parallelism alone, or name one with tp_axis=")
    return others[-1]


def expert_axis(axes: dict[str, int], tp_axis: str) -> str | None:
    return next((name for name in axes if name in EXPERT_AXES and name != tp_axis and axes[name] > 1), None)


def check_axes(axes: dict[str, int], tp_axis: str) -> None:
    """Every axis but the tensor-parallel one must be a data axis the cost model prices, or
    the expert axis; an axis of size 1 does nothing, so its name does not matter."""
    for name, size in axes.items():
        if name == tp_axis or name in DATA_AXES or name in EXPERT_AXES or size == 1:
            continue
        rest = {k: v for k, v in axes.items() if k != name}
        what, instead = UNMODELLED.get(name, (None, None))
        if what is None:
            raise ValueError(
                f"mesh axis {name!r} (size {size}) is neither the tensor-parallel axis {tp_axis!r} nor a data axis "
                f"({', '.join(DATA_AXES)}), so the planner cannot price it; name data-parallel axes one of those "
                f"(e.g. {{'dp': {size}, {tp_axis!r}: {axes[tp_axis]}}}; mesh_dim_names= for a DeviceMesh), or pass "
                f"tp_axis={name!r} if it is the tensor-parallel one")
        raise ValueError(
            f"mesh axis {name!r} (size {size}) is {what}, which the planner does not model: it plans tensor "
            f"parallelism on {tp_axis!r} and prices {', '.join(DATA_AXES)} as data parallel, and would misprice "
            f"{name!r} as either; {instead}, e.g. on {rest}")


def state_shards(axes: dict[str, int], tp_axis: str, data_parallel: str) -> int:
    """Ranks that split parameter, gradient and optimizer state beyond tp: the last data axis
    under FSDP (see DATA_AXES), none under DDP."""
    data = [name for name in axes if name != tp_axis and (name in DATA_AXES or name in EXPERT_AXES)]
    if data_parallel == "ddp" or not data or data[-1] in REPLICATE_AXES:
        return 1
    return axes[data[-1]]
