"""Spawn-importable workers for ``tests/test_expert_parallel.py`` (no pytest here).

Each rank of an ``ep`` mesh takes its own rows of the batch (``ep`` is a data axis outside
the experts); the reference is one process on the whole batch. Loss: the mean over the
rank's rows, so the one-process gradient is the mean over ranks; dense gradients are
averaged over ``ep`` by hand (what DDP or FSDP over the data axes would do), expert gradients
come out of the style already on that convention.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn import functional as F

from shardplan.analyze.graph import expert_params
from shardplan.apply.experts_ep import ExpertParallel


class TinyBank(nn.Module):
    """Mixtral's bank as Hugging Face writes it: [gate; up] and down per expert, the routing
    weights applied inside, a loop over the experts hit."""

    def __init__(self, experts: int = 4, hidden: int = 8, inner: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
                out = out.index_add(0, token, y)
        return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _compare(ours: dict, ref: dict) -> dict[str, float]:
    """Each gradient's largest difference relative to its largest entry."""
    assert ours.keys() == ref.keys(), (sorted(set(ours) ^ set(ref)))
    return {n: ((ours[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item() for n in ref}


def bank_routed_to_one_rank(rank: int, world: int) -> dict:
    """Every pair routed to rank 0's experts: the other ranks receive nothing and must still
    take part in backward's all-to-all."""
    torch.manual_seed(0)
    bank = TinyBank()
    ref = copy.deepcopy(bank)
    tokens = torch.randn(world, 5, 8)
    idx = torch.tensor([[0, 1]] * 5)
    w = torch.rand(world, 5, 2, requires_grad=True)
    ref_out = ref(tokens.reshape(-1, 8), idx.repeat(world, 1), w.detach().reshape(-1, 2))
    ref_out.pow(2).sum().div(world).backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(bank, mesh, ExpertParallel())
    out = bank(tokens[rank], idx, w[rank].detach())
    out.pow(2).sum().backward()
    return {"out": (out - ref_out.view(world, 5, 8)[rank]).abs().max().item(),
            "grads": _compare(_grads(bank), _grads(ref)), "num_experts": bank.num_experts}


def sorted_rows_to_one_rank(rank: int, world: int) -> dict:
    """torchtitan's convention (``bank(num_tokens_per_expert, rows sorted by expert)``), every
    row for rank 0's experts (0 and 1 of 4): the other ranks receive nothing and must still
    take part in backward's all-to-all. One process runs every rank's rows, by expert."""
    from tests.portability.titan_moe import GroupedExperts

    torch.manual_seed(0)
    bank = GroupedExperts(8, 6, 4)
    ref = copy.deepcopy(bank)
    rows = torch.randn(world, 5, 8)
    counts = torch.tensor([3, 2, 0, 0])
    whole = torch.cat([rows[:, :3].reshape(-1, 8), rows[:, 3:].reshape(-1, 8)])  # expert 0's rows, then 1's
    ref_out = ref(counts * world, whole)
    ref_out.pow(2).sum().div(world).backward()
    mine = torch.cat([ref_out[3 * rank:3 * rank + 3], ref_out[3 * world + 2 * rank:3 * world + 2 * rank + 2]])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(bank, mesh, ExpertParallel())
    out = bank(counts, rows[rank])
    out.pow(2).sum().backward()
    return {"out": (out - mine.detach()).abs().max().item(), "grads": _compare(_grads(bank), _grads(ref))}


def _head(out) -> torch.Tensor:
    """The logits, or a base model's last hidden state."""
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _average_dense(model: nn.Module, world: int) -> None:
    for p in model.parameters():
        if p.grad is not None and not isinstance(p.grad, DTensor):  # dense: averaged over the data ranks
            dist.all_reduce(p.grad)
            p.grad /= world


def hf_model_matches(rank: int, world: int, model_type: str, steps: int = 0) -> dict:
    """Logits and every gradient against one process; with ``steps``, the weights after that
    many AdamW steps; the collectives of one training step as CommDebugMode counts them."""
    from torch.distributed.tensor.debug import CommDebugMode

    from shardplan.interop.hf import build_hf_model

    model, (ids,), _ = build_hf_model(model_type, tiny=True, device="cpu", seed=0, batch_size=2 * world)
    model.train()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    banks = {n: ExpertParallel() for n, m in model.named_modules() if expert_params(m) is not None}
    parallelize_module(model, mesh, banks)
    mine = ids.chunk(world)[rank]
    counter = CommDebugMode()
    with counter:
        logits = model(mine).logits
        logits.float().pow(2).mean().backward()
    ref(ids).logits.float().pow(2).mean().backward()
    _average_dense(model, world)
    with torch.no_grad():
        full = ref(ids).logits
    out = {"banks": sorted(banks), "logits": (logits - full.chunk(world)[rank]).abs().max().item(),
           "grads": _compare(_grads(model), _grads(ref)),
           "local_experts": [m.gate_up_proj.to_local().shape[0] for n, m in model.named_modules() if n in banks][:1],
           "counts": {str(k): v for k, v in counter.get_comm_counts().items()}}
    if steps:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
        for step in range(steps):
            for opt in opts:
                opt.step()
                opt.zero_grad()
            if step + 1 < steps:
                model(mine).logits.float().pow(2).mean().backward()
                _average_dense(model, world)
                ref(ids).logits.float().pow(2).mean().backward()
        ours = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
        out["weights"] = _compare(ours, dict((n, p.detach()) for n, p in ref.named_parameters()))
    return out


def every_model(rank: int, world: int, model_types: list[str]) -> dict:
    return {t: hf_model_matches(rank, world, t, steps=2 if t == "mixtral" else 0) for t in model_types}


def expert_count(model_type: str) -> int:
    from shardplan.interop.hf import build_hf_model

    model, _, _ = build_hf_model(model_type, tiny=True)
    return next(m.gate_up_proj.shape[0] for m in model.modules() if expert_params(m) is not None)


def planned_matches(rank: int, world: int, model_type: str, plan_yaml: str, fsdp: bool, axes: tuple,
                    train: bool = True) -> dict:
    """``apply_plan`` (and ``fully_shard_plan``) of an ep plan against one process: each data
    rank (dp x ep) its own rows of the batch; the gradients as the data-parallel mean. Models
    whose router samples in training mode (PhiMoE's sparsemixer) compare with ``train=False``."""
    import shardplan
    from shardplan.interop.hf import build_hf_model

    plan = shardplan.Plan.from_yaml(plan_yaml)
    sizes = tuple(plan.mesh.axes[a] for a in axes)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=axes)
    # the data ranks: every axis but tp (whose ranks share their rows)
    data_rank, data_world = 0, 1
    for axis, coordinate in zip(axes, mesh.get_coordinate()):
        if axis != plan.mesh.tp_axis:
            data_rank, data_world = data_rank * plan.mesh.axes[axis] + coordinate, data_world * plan.mesh.axes[axis]
    model, (ids,), _ = build_hf_model(model_type, tiny=True, device="cpu", seed=0, batch_size=2 * data_world)
    model.train(train)
    ref = copy.deepcopy(model)
    shardplan.apply_plan(model, mesh, plan)
    if fsdp:
        from shardplan.apply.fsdp import fully_shard_plan

        fully_shard_plan(model, mesh, plan)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    mine = ids.chunk(data_world)[data_rank]
    losses = []
    for step in range(2):
        logits = _head(model(mine))
        logits.float().pow(2).mean().backward()
        if not fsdp:
            _average_dense(model, world)
        _head(ref(ids)).float().pow(2).mean().backward()
        if step == 0:
            grads = _compare(_grads(model), _grads(ref))
            with torch.no_grad():
                first = (logits - _head(ref(ids)).chunk(data_world)[data_rank]).abs().max().item()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(logits.float().pow(2).mean().item())
    ours = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return {"logits": first, "grads": grads,
            "weights": _compare(ours, {n: p.detach() for n, p in ref.named_parameters()}),
            "placements": {n: str(getattr(p, "placements", "plain")) for n, p in model.named_parameters()}}


def planned_families(rank: int, world: int, cases: list[tuple[str, str]], fsdp: bool, axes: tuple) -> dict:
    return {t: planned_matches(rank, world, t, plan_yaml, fsdp, axes) for t, plan_yaml in cases}


# --- checkpoints: DCP at one ep, loaded at another and unsharded ------------------------------

def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)

def _sharded_mixtral(seed: int, rank: int, world: int, plan_yaml: str):
    """Mixtral sharded by an ep plan on the plan's (ep, tp) axes; this ep rank's rows."""
    import shardplan
    from shardplan.interop.hf import build_hf_model

    plan = shardplan.Plan.from_yaml(plan_yaml)
    model, (ids,), _ = build_hf_model("mixtral", tiny=True, device="cpu", seed=seed, batch_size=2 * plan.ep)
    axes = (plan.mesh.ep_axis, plan.mesh.tp_axis)
    mesh = init_device_mesh("cpu", (plan.ep, plan.tp), mesh_dim_names=axes)
    shardplan.apply_plan(model, mesh, plan)
    return model, ids.chunk(plan.ep)[mesh.get_coordinate()[0]], mesh


def save_at_ep(rank: int, world: int, plan_yaml: str, folder: str) -> dict:
    """One AdamW step at ep, DCP save of model and optimizer; the gathered model back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import shardplan

    model, mine, mesh = _sharded_mixtral(0, rank, world, plan_yaml)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(mine).logits.float().pow(2).mean().backward()
    for p in model.parameters():  # dense gradients averaged over ep (their tp shards alike), as data parallelism would
        if p.grad is not None and not (isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())):
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=mesh.get_group(0))
            local /= mesh.size(0)
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
    return {"model": shardplan.full_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=_full_options())}


def load_at_ep(rank: int, world: int, plan_yaml: str, folder: str, full: dict, file: str) -> dict:
    """At another ep, into models of other seeds: a DCP load (model and optimizer state), a
    ``load_full_state_dict`` and a ``load_checkpoint`` of a safetensors file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import shardplan

    model, mine, _ = _sharded_mixtral(1, rank, world, plan_yaml)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(mine).logits.float().pow(2).mean().backward()
    opt.step()  # state to overwrite
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, opt, state["optim"])
    out = {"dcp": shardplan.full_state_dict(model), "dcp_optim": get_optimizer_state_dict(model, opt, options=_full_options())}
    other, _, _ = _sharded_mixtral(2, rank, world, plan_yaml)
    shardplan.load_full_state_dict(other, full)
    out["from_full"] = shardplan.full_state_dict(other)
    third, _, _ = _sharded_mixtral(3, rank, world, plan_yaml)
    shardplan.load_checkpoint(third, file)
    out["from_file"] = shardplan.full_state_dict(third)
    out["local"] = {n: tuple(p.to_local().shape) for n, p in third.named_parameters() if isinstance(p, DTensor)}
    return out


def hf_loads_exported_ep_plan(rank: int, world: int, folder: str, ep_plan: dict, config: dict) -> dict:
    """``from_pretrained`` with the exported ``ep_plan`` on the ranks, against one process: the
    logits, and which experts each rank holds (shardplan's Shard(0) over ep: rank r the r-th
    slice of every bank)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(ep_plan=ep_plan, **config))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    mine = {}
    for (name, p), (_, whole) in zip(model.named_parameters(), ref.named_parameters()):
        if isinstance(p, DTensor) and ".experts." in name:
            local, n = p.to_local(), whole.shape[0] // world
            mine[name] = torch.equal(local, whole[rank * n:(rank + 1) * n].to(local.dtype))
    return {"logits": diff, "own_experts": mine}


def planned_families_safe(rank: int, world: int, cases: list[tuple[str, str]], fsdp: bool, axes: tuple,
                          train: bool = True) -> dict:
    """``planned_families``, one family's failure recorded instead of raised (sweeps)."""
    out = {}
    for t, plan_yaml in cases:
        try:
            out[t] = planned_matches(rank, world, t, plan_yaml, fsdp, axes, train)
        except Exception as exc:  # noqa: BLE001 - a sweep's row
            out[t] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
