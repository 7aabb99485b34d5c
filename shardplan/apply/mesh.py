"""Process groups and meshes for planning and tests: the fake group, and a named mesh.

Contract
--------
``fake_process_group(world_size, *, rank=0)``
    Context manager: initializes the default process group with the ``fake``
    backend (no communication; collectives are no-ops), yields, and destroys the
    group on exit.  Raises ``RuntimeError`` if a default group already exists.
    Can be entered again, with another size, in the same process.

``grouped_mesh(tp_mesh, groups)`` / ``kv_group_mesh(tp_mesh, groups)``
    The tp axis as ``(groups, tp / groups)`` (kv heads in groups, each on ``tp / groups``
    consecutive ranks), and its inner axis: the ranks of this rank's group.

``make_mesh(axis_sizes, *, device_type="cpu")``
    ``init_device_mesh`` over the current default group with the mapping's keys
    as dimension names and its values as sizes, in order.  Raises ``ValueError``
    if the sizes' product differs from the world size.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["fake_process_group", "make_mesh", "grouped_mesh", "kv_group_mesh"]


@contextlib.contextmanager
def fake_process_group(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """Initialize a ``fake``-backend default process group for the ``with`` body.

    Raises ``RuntimeError`` if a default process group already exists.  The
    group is destroyed on exit, so the context can be re-entered with another
    ``world_size`` in the same process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_process_group: a default process group is already initialized "
            f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}); destroy it first"
        )
    # init_process_group wraps sys.excepthook to prefix "[rankN]:"; the wrapper outlives the
    # group, so every plan would add one more prefix to the user's tracebacks.
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        sys.excepthook = hook
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding decisions and redistribute planners by mesh *value* (shape and
    axis names), and the cached entries hold the mesh object they were made with. A later real
    mesh of the same shape would get this fake group's mesh back, with the fake rank's
    coordinate: parameters whose global offsets are wrong on every rank but 0 (found through
    ``load_full_state_dict`` after planning on each rank). Drop them with the group."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def make_mesh(axis_sizes: Mapping[str, int], *, device_type: str = "cpu") -> DeviceMesh:
    """Build a ``DeviceMesh`` named by ``axis_sizes``' keys, shaped by its values (in order).

    Needs an initialized default process group whose world size equals the
    product of the sizes; raises ``ValueError`` otherwise.
    """
    if not axis_sizes:
        raise ValueError("make_mesh needs at least one axis")
    names = tuple(axis_sizes.keys())
    sizes = tuple(axis_sizes.values())
    for name, size in axis_sizes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive int size, got {size!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh needs an initialized default process group "
            "(use fake_process_group or call it inside run_on_gloo)"
        )
    product = math.prod(sizes)
    world = dist.get_world_size()
    if product != world:
        raise ValueError(
            f"mesh axes {dict(axis_sizes)} have product {product}, but the world size is {world}"
        )
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def grouped_mesh(tp_mesh: DeviceMesh, groups: int) -> DeviceMesh:
    """The tp axis as ``(groups, tp / groups)``: rank r is in group r // (tp / groups), so a
    ``[Shard(0), Replicate()]`` weight gives the ranks of one group the same rows."""
    name = _axis(tp_mesh)
    rep = tp_mesh.size() // groups
    return tp_mesh._unflatten(0, (groups, rep), (f"{name}_kv{groups}", f"{name}_kv{groups}_rep"))


def kv_group_mesh(tp_mesh: DeviceMesh, groups: int) -> DeviceMesh:
    """The ranks of this rank's group (the inner axis of :func:`grouped_mesh`); the tp axis
    itself for one group."""
    return tp_mesh if groups == 1 else grouped_mesh(tp_mesh, groups)[f"{_axis(tp_mesh)}_kv{groups}_rep"]


def _axis(tp_mesh: DeviceMesh) -> str:
    return tp_mesh.mesh_dim_names[0] if tp_mesh.mesh_dim_names else "tp"
