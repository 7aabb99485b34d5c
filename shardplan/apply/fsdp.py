"""FSDP2 on the data axes of a model the plan already sharded on the tp axis.

Contract
--------
``fully_shard_plan(model, device_mesh, plan, *, options=FSDPOptions())`` calls
``torch.distributed.fsdp.fully_shard`` on the units :func:`fsdp_units` lists, in that order
(each repeated block, then the root), over the data sub-mesh: one axis is plain FSDP
(``Shard(0)`` over it), two axes ``(replicate, shard)`` are HSDP (fully_shard's 2-D mesh:
``(Replicate(), Shard(0))``). Each tp-local shard is what FSDP shards further, so a weight
ends up a DTensor on the (data..., tp) mesh. The model is modified in place and returned.
An expert-parallel plan (``mesh.ep_axis``) treats ep as one more data axis for every module
but its ``ep_experts`` banks: each bank is its own unit over the data axes outside ep and tp
(none: its parameters are left out of its block's unit), made before the block's; experts
written as a list are each their own unit, those the rank holds.
The units and their ``reshard_after_forward`` come from :func:`shardplan.decide.fsdp.fsdp_units`,
which the estimate prices too (choices, after torchtitan's ``apply_fsdp``, documented there).
Mistakes (no data axis, an axis the mesh lacks, a model ``apply_plan`` has not sharded, a plan
for another tp) are ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..analyze.graph import EXPERT_CONTAINERS
from ..decide import fsdp as units_of
from ..plan.model import Plan, expand_pattern
from .emit import check_fingerprint
from .experts_listed import held_whole

__all__ = ["FSDPOptions", "fully_shard_plan", "fsdp_units", "data_mesh"]


@dataclass(frozen=True)
class FSDPOptions:
    """How :func:`fully_shard_plan` shards the data axes.

    ``axes``: the mesh axes to shard over, outermost first (``None``: every axis but the
    plan's tp axis); one axis is FSDP, two are HSDP ``(replicate, shard)``.
    ``reshard_after_forward``: torchtitan's policy names: ``"default"`` reshards every block
    but the last (backward needs it at once), ``"always"`` every block, ``"never"`` none; the
    root is never resharded. ``mp_policy`` and ``offload_policy`` go to ``fully_shard`` as given.
    """

    axes: tuple[str, ...] | None = None
    reshard_after_forward: units_of.ReshardPolicy = "default"
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)


def fsdp_units(plan: Plan, model: nn.Module, *, reshard_after_forward: units_of.ReshardPolicy = "default") -> list[tuple[str, bool]]:
    """``[(module path, reshard_after_forward), ...]``, the root ``""`` last: what
    :func:`fully_shard_plan` wraps and the estimate prices."""
    return units_of.fsdp_units(plan.model.repeats, model, reshard_after_forward=reshard_after_forward)


def fully_shard_plan(model: nn.Module, device_mesh: DeviceMesh, plan: Plan, *, options: FSDPOptions | None = None) -> nn.Module:
    """``fully_shard`` every unit of :func:`fsdp_units` over the data axes; see the module docstring."""
    options = options if options is not None else FSDPOptions()
    _check_model(model, plan)
    mesh = data_mesh(device_mesh, plan, options.axes)
    config: dict[str, Any] = {"mp_policy": options.mp_policy, "offload_policy": options.offload_policy}
    banks = [f for r in plan.rules if r.style == "ep_experts" for f in expand_pattern(r.module, plan.model.repeats)]
    expert_mesh = _expert_data_mesh(device_mesh, plan) if banks else None
    for path, reshard in fsdp_units(plan, model, reshard_after_forward=options.reshard_after_forward):
        # expert banks first, each its own unit over the data axes outside ep (none: left out)
        inside = [b for b in banks if not path or b == path or b.startswith(path + ".")]
        banks = [b for b in banks if b not in inside]
        ignored = set()
        for bank in (unit for b in inside for unit in _expert_units(model.get_submodule(b), b)):
            if expert_mesh is not None:
                fully_shard(model.get_submodule(bank), mesh=expert_mesh, reshard_after_forward=reshard, **config)
            else:
                ignored.update(model.get_submodule(bank).parameters())
        fully_shard(model.get_submodule(path), mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None,
                    **config)
    return model


def _expert_units(module: nn.Module, fqn: str) -> list[str]:
    """A bank is one unit; a list of experts, each expert this rank holds (its dispatch calls
    each once per layer call, so each unit's all-gather runs on every rank)."""
    if not isinstance(module, EXPERT_CONTAINERS):
        return [fqn]
    return [f"{fqn}.{name}" for name, m in module.named_children() if any(True for _ in m.parameters())]


def _expert_data_mesh(device_mesh: DeviceMesh, plan: Plan) -> DeviceMesh | None:
    """The data axes outside ep and tp, where expert banks are sharded (HSDP over two)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    axes = tuple(n for n in names if n not in (plan.mesh.tp_axis, plan.mesh.ep_axis) and device_mesh[n].size() > 1)
    if not axes:
        return None
    return device_mesh[axes[0]] if len(axes) == 1 else device_mesh[axes[-2:]]


def data_mesh(device_mesh: DeviceMesh, plan: Plan, axes: tuple[str, ...] | None = None) -> DeviceMesh:
    """The sub-mesh FSDP runs on: ``device_mesh[axes]`` (every non-tp axis by default)."""
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"fully_shard_plan needs a DeviceMesh; got {type(device_mesh).__name__}. Use the mesh "
                         "apply_plan was given, e.g. init_device_mesh('cuda', (8, 8), mesh_dim_names=('dp', 'tp'))")
    names = tuple(device_mesh.mesh_dim_names or ())
    tp_axis = plan.mesh.tp_axis
    if plan.tp == 1 and plan.mesh.ep_axis in names and tp_axis not in names:  # {"ep": 8}: every axis is data to dense modules
        chosen = names if axes is None else tuple(axes)
        return device_mesh[chosen[0]] if len(chosen) == 1 else device_mesh[chosen]
    if tp_axis not in names:
        raise ValueError(f"the mesh's axes are {names or 'unnamed'}, but the plan's tp axis is {tp_axis!r}; give the "
                         f"mesh apply_plan used, with mesh_dim_names naming {tp_axis!r} and the data axes")
    if device_mesh[tp_axis].size() != plan.tp:
        raise ValueError(f"the plan was made for tp={plan.tp} but the mesh's {tp_axis!r} axis has "
                         f"{device_mesh[tp_axis].size()} ranks; re-plan for this mesh")
    chosen = tuple(n for n in names if n != tp_axis) if axes is None else tuple(axes)
    _check_axes(chosen, names, tp_axis)
    return device_mesh[chosen[0]] if len(chosen) == 1 else device_mesh[chosen]


def _check_axes(axes: tuple[str, ...], names: tuple[str, ...], tp_axis: str) -> None:
    data = [n for n in names if n != tp_axis]
    if not axes:
        raise ValueError(f"the mesh {names} has no data axis besides {tp_axis!r}: there is nothing for FSDP to shard "
                         f"over; make the mesh with one, e.g. mesh_dim_names=('dp', {tp_axis!r})")
    unknown = [a for a in axes if a not in names]
    if unknown:
        raise ValueError(f"FSDPOptions.axes {axes} names {unknown}, which the mesh {names} lacks; use some of {data}")
    if tp_axis in axes:
        raise ValueError(f"FSDPOptions.axes {axes} includes the tp axis {tp_axis!r}; FSDP shards the data axes, "
                         f"use some of {data}")
    if len(axes) > 2 or len(set(axes)) != len(axes):
        raise ValueError(f"FSDPOptions.axes {axes}: expected one data axis (FSDP) or two distinct ones (HSDP: "
                         "replicate, shard); flatten more axes into one first, e.g. mesh['a', 'b']._flatten('dp')")
    if "dp_replicate" in axes[1:]:  # fully_shard's 2-D mesh replicates over its first dim
        raise ValueError(f"FSDPOptions.axes {axes} puts 'dp_replicate' second, where HSDP shards; list it first, "
                         f"('dp_replicate', ...), with the mesh's axes in that order")
    if list(axes) != sorted(axes, key=names.index):
        raise ValueError(f"FSDPOptions.axes {axes} are not in the mesh's order {names}; list them outermost first, "
                         f"e.g. {tuple(sorted(axes, key=names.index))}")


def _check_model(model: nn.Module, plan: Plan) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"fully_shard_plan needs an nn.Module; got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise ValueError(f"fully_shard_plan needs a shardplan Plan; got {type(plan).__name__} (load one with load_plan)")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} already has fully_shard applied; call fully_shard_plan once, "
                         "after apply_plan, on a model FSDP has not wrapped")
    check_fingerprint(model, plan)
    held = held_whole(model)  # heads a tp rank holds whole (listed_heads): plain tensors, its own
    params = [(n, p) for n, p in model.named_parameters()  # expert banks sit on the ep axis (and tp)
              if not (isinstance(p, DTensor) and plan.mesh.ep_axis in (p.device_mesh.mesh_dim_names or ())) and n not in held]
    plain = next((n for n, p in params if not isinstance(p, DTensor)), None)
    if plain is not None and not (plan.tp == 1 and plan.mesh.ep_axis):  # an ep plan without a tp axis leaves them plain
        raise ValueError(f"{type(model).__name__} is not sharded on the tp axis yet ({plain!r} is a plain tensor, "
                         "expected a DTensor); call shardplan.apply_plan(model, mesh, plan) first, then fully_shard_plan")
    for name, p in params:
        if isinstance(p, DTensor) and p.device_mesh.size() != plan.tp:  # 2-D: the tp axis unflattened for kv heads in groups
            raise ValueError(f"{name!r} is sharded over {p.device_mesh.size()} ranks (mesh {p.device_mesh.mesh_dim_names}), "
                             f"but the plan given is for tp={plan.tp}; pass the plan apply_plan applied")
