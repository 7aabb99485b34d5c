"""Spawn-importable workers for ``tests/test_listed_experts.py`` (no pytest here).

Each data rank (ep, and dp where the mesh has it) takes its own rows of the batch; the
reference is one process on the whole batch, its loss the mean over every row, so the
ranks' gradients are their mean: dense ones averaged by hand (or by FSDP), the experts' come
out of the dispatch already so. An expert's gradient lives on the rank that holds it.
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


def _build(spec: str) -> nn.Module:
    module, _, fn = spec.partition(":")
    return getattr(importlib.import_module(module), fn)()


def _data_rank(mesh, plan) -> tuple[int, int]:
    rank, world = 0, 1
    for axis, coordinate in zip(mesh.mesh_dim_names, mesh.get_coordinate()):
        if axis != plan.mesh.tp_axis:
            rank, world = rank * plan.mesh.axes[axis] + coordinate, world * plan.mesh.axes[axis]
    return rank, world


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(ours: dict, ref: dict) -> dict[str, float]:
    """Each tensor's largest difference relative to its largest entry, over the names we hold."""
    return {n: ((ours[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item() for n in ours}


def _dense_mean(model: nn.Module, world: int, listed: set[str]) -> None:
    for n, p in model.named_parameters():
        if p.grad is not None and n not in listed:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=_DATA_GROUP[0])
            g /= world


_DATA_GROUP: list = [None]


def matches(rank: int, world: int, spec: str, plan_yaml: str, fsdp: bool = False, steps: int = 2,
            count: bool = True) -> dict:
    """Logits, every gradient we hold and the weights after ``steps`` AdamW steps, against one
    process on the whole batch; the collectives of the first step as CommDebugMode counts them."""
    from torch.distributed.tensor.debug import CommDebugMode

    import shardplan
    from shardplan.apply.experts_listed import held_elsewhere

    plan = shardplan.Plan.from_yaml(plan_yaml)
    axes = tuple(plan.mesh.axes)
    mesh = init_device_mesh("cpu", tuple(plan.mesh.axes.values()), mesh_dim_names=axes)
    data_axes = tuple(a for a in axes if a != plan.mesh.tp_axis)
    _DATA_GROUP[0] = (mesh[data_axes[0]] if len(data_axes) == 1 else mesh[data_axes]._flatten()).get_group()
    data_rank, data_world = _data_rank(mesh, plan)
    model = _build(spec)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2 * data_world, 16), generator=torch.Generator().manual_seed(1))
    shardplan.apply_plan(model, mesh, plan)
    if fsdp:
        from shardplan.apply.fsdp import fully_shard_plan

        fully_shard_plan(model, mesh, plan)
    elsewhere = held_elsewhere(model)
    listed = {n for n, _ in model.named_parameters() if ".experts." in n}
    mine = ids.chunk(data_world)[data_rank]
    # Adam's first step is lr * sign(grad) where eps is far below |grad|: a gradient entry that
    # is rounding noise around 0 (1e-12 here, -1e-12 there) would move by 2 lr either way
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, ref)]
    counter = CommDebugMode()
    out: dict = {"held_elsewhere": len(elsewhere), "experts_here": len({n.rsplit(".", 2)[0] for n in listed})}
    for step in range(steps):
        with counter if step == 0 and count else torch.enable_grad():
            logits = model(mine)
            logits.float().pow(2).mean().backward()
        if not fsdp:
            _dense_mean(model, data_world, listed)
        full = ref(ids)
        full.float().pow(2).mean().backward()
        if step == 0:
            out["logits"] = (logits - full.chunk(data_world)[data_rank]).abs().max().item()
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            ours = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            out["missing_grads"] = sorted(n for n, p in model.named_parameters() if (p.grad is None) != (ref_grads[n] is None))
            out["grads"] = _compare(ours, ref_grads)
            out["counts"] = {str(k): v for k, v in counter.get_comm_counts().items()}
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ours = {n: _full(p).detach() for n, p in model.named_parameters()}
    out["weights"] = _compare(ours, {n: p.detach() for n, p in ref.named_parameters()})
    with torch.no_grad():  # serving: eval mode, no autograd, another batch size on each rank
        model.eval(), ref.eval()
        few = ids[: data_world * 3]
        out["eval_logits"] = (model(few.chunk(data_world)[data_rank]) - ref(few).chunk(data_world)[data_rank]).abs().max().item()
    out["names"] = sorted(ours)
    out["elsewhere_names"] = sorted(elsewhere)
    return out


# --- checkpoints: DCP at one ep, loaded at another and unsharded ------------------------------

def _sharded(spec: str, plan_yaml: str, seed: int):
    import shardplan

    plan = shardplan.Plan.from_yaml(plan_yaml)
    mesh = init_device_mesh("cpu", tuple(plan.mesh.axes.values()), mesh_dim_names=tuple(plan.mesh.axes))
    torch.manual_seed(seed)
    model = _build(spec)
    for p in model.parameters():  # another seed's weights: a load must overwrite every one
        p.data.add_(seed)
    return shardplan.apply_plan(model, mesh, plan), mesh, plan


def save_at(rank: int, world: int, spec: str, plan_yaml: str, folder: str) -> dict:
    """One AdamW step on this rank's rows, DCP save of model and optimizer state; the model
    gathered whole (``full_state_dict``) and the keys this rank's DCP shard wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardplan.apply.state import full_state_dict

    model, mesh, plan = _sharded(spec, plan_yaml, 0)
    data_rank, data_world = _data_rank(mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2 * data_world, 16), generator=torch.Generator().manual_seed(1))
    model(ids.chunk(data_world)[data_rank]).float().pow(2).mean().backward()
    _DATA_GROUP[0] = mesh[plan.mesh.ep_axis].get_group()
    _dense_mean(model, data_world, {n for n, _ in model.named_parameters() if ".experts." in n})
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return {"full": full_state_dict(model), "held": sorted(model.state_dict())}


def load_at(rank: int, world: int, spec: str, plan_yaml: str, folder: str) -> dict:
    """DCP load into a model sharded by another plan (its experts not the saver's): the model
    gathered whole, and this rank's optimizer state of its experts' weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardplan.apply.state import full_state_dict

    model, _, _ = _sharded(spec, plan_yaml, 7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()  # optimizer state to load into
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _, osd = get_state_dict(model, opt)
    moments = {k: _full(v["exp_avg"]) for k, v in osd["state"].items() if ".experts." in k}
    return {"full": full_state_dict(model), "moments": moments}


def round_trip(rank: int, world: int, spec: str, plan_yaml: str, folder: str) -> dict:
    """``load_full_state_dict`` and ``load_checkpoint`` (a safetensors file of the unsharded
    model) into models sharded by the plan, one of them built on meta and materialized: each
    gathered back whole."""
    from safetensors.torch import load_file

    from shardplan.apply.load import load_checkpoint
    from shardplan.apply.state import full_state_dict, load_full_state_dict

    whole = load_file(f"{folder}/model.safetensors")
    a, _, _ = _sharded(spec, plan_yaml, 3)
    load_full_state_dict(a, whole)
    b, _, _ = _sharded(spec, plan_yaml, 5)
    load_checkpoint(b, folder)
    import shardplan
    from shardplan.apply.load import materialize

    plan = shardplan.Plan.from_yaml(plan_yaml)
    mesh = init_device_mesh("cpu", tuple(plan.mesh.axes.values()), mesh_dim_names=tuple(plan.mesh.axes))
    with torch.device("meta"):  # built on meta, sharded, allocated, then read: no whole model on any rank
        c = _build(spec)
    shardplan.apply_plan(c, mesh, plan)
    load_checkpoint(materialize(c, seed=0), folder)
    return {"state_dict": full_state_dict(a), "checkpoint": full_state_dict(b), "meta": full_state_dict(c),
            "meta_held": sorted(c.state_dict())}
