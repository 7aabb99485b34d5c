"""Spawn-importable model, plan and workers for ``tests/test_unequal_packed.py`` (no pytest here).

The model is GQA attention written the way litgpt and gpt-fast write it: one fused
``wqkv = nn.Linear(D, (h + 2 kv) hd)`` cut by ``split([q_size, kv_size, kv_size], -1)``,
views by heads, ``repeat_interleave`` of the kv heads, SDPA, ``wo``. The plan is written by
hand: ``wqkv`` ``packed_colwise`` with ``packed: [h, kv, kv]`` (rank r keeps [q_r; k_r; v_r]),
``wo`` rowwise, the MLP colwise/rowwise, the rest replicated, and the attention's sizes
(``n_head``, ``n_kv``, ``q_size``, ``kv_size``) made local by the plan's ``attributes``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

import shardplan
from shardplan.plan.model import fingerprint

DIM, VOCAB, LAYERS, HEAD_DIM = 32, 64, 2, 8
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Attention(nn.Module):
    def __init__(self, n_head: int, n_kv: int) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, HEAD_DIM
        self.q_size, self.kv_size = n_head * HEAD_DIM, n_kv * HEAD_DIM
        self.wqkv = nn.Linear(DIM, (n_head + 2 * n_kv) * HEAD_DIM, bias=True)
        self.wo = nn.Linear(n_head * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.q_size))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, n_head: int, n_kv: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention(n_head, n_kv)
        self.norm2, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GQAModel(nn.Module):
    def __init__(self, n_head: int = 8, n_kv: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(n_head, n_kv) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(seed: int, n_head: int = 8, n_kv: int = 2) -> GQAModel:
    torch.manual_seed(seed)
    model = GQAModel(n_head, n_kv)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make every tensor seed-dependent
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def plan_yaml(tp: int, n_head: int = 8, n_kv: int = 2, *, parts: list[int] | None = None, whole: bool = False) -> str:
    """The hand-written plan: ``packed: [h, kv, kv]`` unless ``parts`` says otherwise; with
    ``whole`` (one kv head, MQA), ``whole_parts: 2``: k and v gathered whole on every rank,
    so only the query sizes are made local."""
    model = GQAModel(n_head, n_kv)
    parts = parts or [n_head, n_kv, n_kv]
    local = {"n_head": n_head // tp, "n_kv": n_kv // tp, "q_size": n_head * HEAD_DIM // tp,
             "kv_size": n_kv * HEAD_DIM // tp}
    if whole:
        local = {"n_head": n_head // tp, "q_size": n_head * HEAD_DIM // tp}
    packed = {"packed": parts, **({"whole_parts": 2} if whole else {})}
    rules = [("embed", "replicate"), ("layers.*.norm1", "replicate"), ("layers.*.attn.wqkv", "packed_colwise"),
             ("layers.*.attn.wo", "rowwise"), ("layers.*.norm2", "replicate"), ("layers.*.mlp.w1", "colwise"),
             ("layers.*.mlp.w2", "rowwise"), ("norm", "replicate"), ("head", "replicate")]
    data = {
        "version": 1,
        "model": {"class_name": "GQAModel", "fingerprint": fingerprint(model),
                  "num_params": sum(p.numel() for p in model.parameters()), "repeats": {"layers": LAYERS}},
        "mesh": {"axes": {"tp": tp}, "tp_axis": "tp"},
        "rules": [{"module": m, "style": s, **(packed if s == "packed_colwise" else {})} for m, s in rules],
        "attributes": [{"module": "layers.*.attn", "values": local}],
    }
    return shardplan.Plan.model_validate(data).to_yaml()


def sharded(seed: int, world_size: int, yaml: str, n_head: int = 8, n_kv: int = 2) -> GQAModel:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = build(seed, n_head, n_kv)
    shardplan.apply_plan(model, mesh, shardplan.Plan.from_yaml(yaml))
    return model


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, -2), ids.roll(-1, dims=1).flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(model: nn.Module, steps: int = 2, *, foreach: bool | None = None) -> dict[str, Any]:
    """Outputs, every gradient after the first backward, every weight and the optimizer's
    moments after ``steps`` AdamW steps, all gathered to their global views."""
    ids = tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    out: dict[str, Any] = {"logits": model(ids).detach().clone()}
    for step in range(steps):
        loss_of(model, ids).backward()
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    out["moments"] = {n: {k: _full(v) for k, v in opt.state[p].items() if k != "step"} for n, p in model.named_parameters()}
    out["placements"] = {n: [repr(x) for x in p.placements] for n, p in model.named_parameters() if hasattr(p, "placements")}
    return out


def train_sharded(rank: int, world_size: int, yaml: str, foreach: bool | None, n_kv: int = 2) -> dict[str, Any]:
    return train(sharded(0, world_size, yaml, n_kv=n_kv), foreach=foreach)


def save_sharded(rank: int, world_size: int, yaml: str, folder: str, n_kv: int = 2) -> dict[str, Any]:
    """One AdamW step at tp, then DCP save of model and optimizer; the gathered state back."""
    model = sharded(0, world_size, yaml, n_kv=n_kv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, tokens()).backward()
    opt.step()
    opt.zero_grad()
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
    return {"model": shardplan.full_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FULL),
            "chunks": {n: [(tuple(c.offsets), tuple(c.sizes)) for c in p.__create_chunk_list__()]
                       for n, p in model.named_parameters() if n.endswith("wqkv.weight")}}


def load_sharded(rank: int, world_size: int, yaml: str, folder: str, full: dict[str, torch.Tensor],
                 file: str, n_kv: int = 2) -> dict[str, Any]:
    """At tp: a DCP load (model and optimizer), a ``load_full_state_dict`` and a
    ``load_checkpoint`` of a safetensors file, each into a model of another seed."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model = sharded(1, world_size, yaml, n_kv=n_kv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, tokens()).backward()
    opt.step()  # state to overwrite
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, opt, state["optim"])
    out = {"dcp": shardplan.full_state_dict(model), "dcp_optim": get_optimizer_state_dict(model, opt, options=FULL)}
    other = sharded(2, world_size, yaml, n_kv=n_kv)
    shardplan.load_full_state_dict(other, full)
    out["from_full"] = shardplan.full_state_dict(other)
    third = sharded(3, world_size, yaml, n_kv=n_kv)
    shardplan.load_checkpoint(third, file)
    out["from_file"] = shardplan.full_state_dict(third)
    with torch.no_grad():
        out["logits"] = third(tokens())
    return out
