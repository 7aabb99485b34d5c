"""Train with a checked-in plan: TP on the ``tp`` axis, FSDP2 on ``dp``, checked against one process.

    torchrun --nproc-per-node 4 examples/train.py --plan examples/llama3-debug.dp2-tp2.yaml --checkpoint /tmp/ckpt

On a 2x2 mesh ``(dp, tp)`` of gloo CPU ranks: the ``llama3-debug`` preset, the plan applied
with FSDP2 on ``dp`` (``apply_plan(..., fsdp=True)``), 3 AdamW steps with gradient clipping,
each over 2 micro-batches of gradient accumulation (the first without gradient sync), the
global batch split over ``dp``. Every rank also trains an unsharded copy on the whole batch
and the script compares losses and final weights. Then it saves model and optimizer with DCP,
loads them into a fresh model sharded at tp=4 (all 4 ranks on one ``tp`` axis) and into an
unsharded model (one process, rank 0), and compares every tensor. It prints one line per check
and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import shardplan
from shardplan.models import build_preset

STEPS, MICRO_BATCHES, BATCH, SEQ, LR, MAX_NORM = 3, 2, 4, 32, 1e-2, 1.0
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
# torch's advice, not problems: the preset returns its logits as a view (nothing modifies them in
# place), and gathering a (dp, tp) DTensor for the comparisons takes one collective per axis
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # the one-process load is meant
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def batches(vocab: int) -> list[list[torch.Tensor]]:
    """``STEPS`` global batches, each ``MICRO_BATCHES`` micro-batches of token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return [[torch.randint(0, vocab, (BATCH // MICRO_BATCHES, SEQ + 1), generator=gen) for _ in range(MICRO_BATCHES)]
            for _ in range(STEPS)]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def train(model, ids_per_step, *, dp_rank: int, dp: int, sharded: bool) -> list[float]:
    """AdamW with clipping; each micro-batch's loss is divided by their number so the
    accumulated gradient is the mean over the global batch (FSDP averages over dp)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    losses = []
    for micro_batches in ids_per_step:
        total = 0.0
        for i, ids in enumerate(micro_batches):
            if sharded:  # reduce gradients only on the last micro-batch of the step
                shardplan.set_requires_gradient_sync(model, i == len(micro_batches) - 1)
                ids = ids.chunk(dp)[dp_rank]
            loss = lm_loss(model, ids) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, optimizer


def report(name: str, worst: float, tol: float) -> bool:
    ok = worst <= tol
    if dist.get_rank() == 0:
        print(f"{name}: {'equal' if ok else 'DIFFERENT'} (max |diff| {'<=' if ok else '>'} {tol:g})", flush=True)
    return ok


def max_diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:5]
    return max(float((got[k].float() - want[k].float()).abs().max()) if got[k].numel() else 0.0 for k in want)


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def fresh(plan: shardplan.Plan | None, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Another model (other seed: every tensor must come from the checkpoint) and an
    optimizer with state, sharded by ``plan`` on ``mesh`` unless ``plan`` is None."""
    model = build_preset("llama3-debug", device="cpu", seed=99)
    if plan is not None:
        shardplan.apply_plan(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    lm_loss(model, batches(model.tok_embeddings.num_embeddings)[0][0][:1]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def load(model, optimizer, folder: str, **kwargs) -> dict[str, torch.Tensor]:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder, **kwargs)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return {**{f"model.{k}": v for k, v in shardplan.full_state_dict(model).items()},
            **{f"optim.{k}": v for k, v in flat(get_optimizer_state_dict(model, optimizer, options=FULL)).items()}}


def main() -> int:
    args = argparse.ArgumentParser()
    args.add_argument("--plan", required=True)
    args.add_argument("--checkpoint", required=True)
    args = args.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = shardplan.load_plan(args.plan)
    model, reference = (build_preset("llama3-debug", device="cpu", seed=0) for _ in range(2))
    shardplan.apply_plan(model, mesh, plan, fsdp=True)
    data = batches(reference.tok_embeddings.num_embeddings)
    dp_group = mesh["dp"].get_group()
    losses, optimizer = train(model, data, dp_rank=mesh["dp"].get_local_rank(), dp=2, sharded=True)
    for loss in losses:  # each dp rank saw half of the batch: the global loss is their mean
        dist.all_reduce(loss, group=dp_group)
    ref_losses, _ = train(reference, data, dp_rank=0, dp=1, sharded=False)
    ok = report("losses, 3 steps vs one process", max(abs(float(a) / 2 - float(b)) for a, b in zip(losses, ref_losses)), 1e-5)
    trained = shardplan.full_state_dict(model)
    # AdamW divides each gradient element by its own running size, so an element whose
    # gradient is a near-cancelling sum (float32 noise of a few percent, moving with the
    # BLAS kernel) moves by a slightly different fraction of LR; a wrong gradient moves a
    # weight by about LR per step, far past LR / 10
    ok &= report("weights after 3 steps vs one process", max_diff(trained, reference.state_dict()), LR / 10)

    saved = {**{f"model.{k}": v for k, v in trained.items()},
             **{f"optim.{k}": v for k, v in flat(get_optimizer_state_dict(model, optimizer, options=FULL)).items()}}
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=args.checkpoint)
    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    plan4 = shardplan.plan_model(build_preset("llama3-debug", device="meta"), tp4, seq_len=SEQ)
    ok &= report("DCP tp=2 x dp=2 -> tp=4, every model and optimizer tensor", max_diff(load(*fresh(plan4, tp4), args.checkpoint), saved), 0.0)
    if dist.get_rank() == 0:  # one process, no process group involved
        ok &= report("DCP tp=2 x dp=2 -> unsharded, every tensor", max_diff(load(*fresh(None, None), args.checkpoint, no_dist=True), saved), 0.0)
    ok = torch.tensor(int(ok))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    code = main()
    os._exit(code)  # gloo workers can abort at interpreter exit; leave cleanly
