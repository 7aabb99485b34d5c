"""Real training-step time on 2 gloo ranks: the auto plan vs torchtitan's hand plans.

One run, one pair of gloo ranks (``shardplan.tools.launch.run_on_gloo``, one thread per rank),
three copies of the same Llama (same seed, same weights, same batch) in the same worker
processes, each tensor-parallel over tp=2 a different way:

  A  auto   ``shardplan.plan_model(..., hardware="cpu-gloo")`` then ``shardplan.apply_plan``
  B  tt-sp  torchtitan's ``apply_tp`` written out with torch's own styles (sequence parallel)
  C  tt-nosp the same without sequence parallel: per-Linear TP, one PrepareModuleInput per
            block so wq/wk/wv (and w1/w3) share one backward all-reduce, norms replicated

B and C are written from pytorch/torchtitan, torchtitan/models/llama3/infra/parallelize.py,
``apply_tp`` (commit 018740b7aae7846d24954539244c78215dbd181f), with ``loss_parallel=False``
(output ``Replicate``, so all three compute the same plain cross-entropy), no float8, no
context parallel. Our ``Attention.forward`` takes ``(x, cos, sin)``, so the attention
``PrepareModuleInput`` has three entries where torchtitan's has four.

A step is forward, cross-entropy, backward, ``AdamW(foreach=True).step()``, ``zero_grad``.
One untimed step per variant under ``CommDebugMode`` counts its collectives. After 3
warm-up steps each, the variants alternate step by step, the order rotating each round
(ABC, BCA, CAB, ...), a barrier before every step; a step's time is the max over the two ranks; the table shows the
median per variant. The losses of the three variants are compared step by step as a check
that they train the same model on the same data.

Usage (from the repo root)::

    python benchmarks/step_time.py [--steps 20] [--dim 512] [--layers 4] [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ("A", "B", "C")
NAMES = {"A": "auto (shardplan)", "B": "torchtitan, SP", "C": "torchtitan, no SP"}


def make_config(args_dict: dict):
    from shardplan.models import LlamaConfig

    return LlamaConfig(
        dim=args_dict["dim"], n_layers=args_dict["layers"], n_heads=args_dict["heads"],
        n_kv_heads=args_dict["kv_heads"], vocab_size=args_dict["vocab"],
        multiple_of=args_dict["multiple_of"], max_seq_len=max(args_dict["seq"], 128),
    )


def build_model(cfg, seed: int = 0, device: str = "cpu") -> nn.Module:
    from shardplan.models import Transformer

    if device == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    torch.manual_seed(seed)
    return Transformer(cfg)


# --------------------------------------------------------------------------- hand plans


def _replicate_norm(module: nn.Module, mesh) -> None:
    """Make a norm's parameters Replicate DTensors, inputs and outputs staying plain tensors.

    Plan C leaves the norms whole; turning their weights into Replicate DTensors (same math,
    no communication: replicated input, replicated weight, replicated gradient) lets every
    parameter be a DTensor, so ``AdamW(foreach=True)`` works for C as for A and B.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from shardplan.apply.emit import ReplicateParallel  # the same generic style shardplan emits

    parallelize_module(module, mesh, ReplicateParallel())


def _reduce_partial_grad(param: torch.Tensor) -> None:
    """A sequence-parallel norm's weight gradient is Partial (a sum over each rank's tokens):
    make it Replicate once per backward. torchtitan leaves this to FSDP; with TP alone the
    Partial gradient otherwise reaches AdamW, whose foreach DTensor ops then redistribute it
    themselves (same losses, checked). shardplan's emitter installs this same hook, so A and
    B pay for it the same way."""
    from torch.distributed.tensor import DTensor, Replicate

    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def apply_torchtitan(model: nn.Module, mesh, *, sequence_parallel: bool) -> nn.Module:
    """torchtitan's ``apply_tp`` (loss_parallel=False), or its no-SP counterpart."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    if sequence_parallel:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        seq, norm_style = Shard(1), SequenceParallel
    else:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        }
        seq, norm_style = Replicate(), None
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = {
            # x, cos, sin: only x becomes a DTensor; use_local_output=False (the default
            # of PrepareModuleInput) lets the Partial input-gradients of wq, wk and wv add
            # up as DTensors, so one collective closes the block in backward
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=False,
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False,
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if norm_style is not None:
            plan["attention_norm"] = norm_style()
            plan["ffn_norm"] = norm_style()
        parallelize_module(block, mesh, plan)
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    for norm in norms:
        if sequence_parallel:
            for p in norm.parameters():
                p.register_post_accumulate_grad_hook(_reduce_partial_grad)
        else:
            _replicate_norm(norm, mesh)
    return model


# --------------------------------------------------------------------------- worker


def _train_step(model, opt, tokens, labels) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def worker(rank: int, world: int, args_dict: dict) -> dict:
    import shardplan
    from shardplan.tools.launch import make_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    cfg = make_config(args_dict)
    mesh = make_mesh({"tp": world})
    bs, seq = args_dict["batch"], args_dict["seq"]
    gen = torch.Generator().manual_seed(1234)  # same batch on every rank
    tokens = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (bs, seq), generator=gen)

    models = {v: build_model(cfg, seed=0) for v in VARIANTS}
    t0 = time.perf_counter()
    plan = shardplan.plan_model(  # the DeviceMesh, not sizes: a process group exists here
        models["A"], mesh, example_inputs=(torch.empty(bs, seq, dtype=torch.long, device="meta"),),
        hardware="cpu-gloo", explain=False,
    )
    plan_s = time.perf_counter() - t0
    shardplan.apply_plan(models["A"], mesh, plan)
    apply_torchtitan(models["B"], mesh, sequence_parallel=True)
    apply_torchtitan(models["C"], mesh, sequence_parallel=False)
    opts = {}
    for v, model in models.items():
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            raise RuntimeError(f"variant {v}: parameters {plain[:4]} are not DTensors; foreach AdamW would fail")
        opts[v] = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    # one untimed step per variant under CommDebugMode: the collectives each plan issues
    from torch.distributed.tensor.debug import CommDebugMode

    comms: dict[str, dict[str, int]] = {}
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        with CommDebugMode() as mode, warnings.catch_warnings():
            # CommDebugMode's module tracker uses full backward hooks, which warn when the
            # module inputs (token ids) need no gradient
            warnings.simplefilter("ignore", UserWarning)
            losses[v].append(float(_train_step(models[v], opts[v], tokens, labels)))
        comms[v] = {str(k).rsplit(".", 1)[-1]: n for k, n in mode.get_comm_counts().items()}

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args_dict["warmup"] + args_dict["steps"]):
        # rotate the order (ABC, BCA, CAB, ...) so no variant always runs first after the barrier
        for v in VARIANTS[i % 3:] + VARIANTS[:i % 3]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = _train_step(models[v], opts[v], tokens, labels)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            losses[v].append(float(loss))
            if i >= args_dict["warmup"]:
                times[v].append(elapsed)
                cpu[v].append(elapsed_cpu)
    # a step's time is the slower rank's
    packed = torch.tensor([[times[v] for v in VARIANTS], [cpu[v] for v in VARIANTS]], dtype=torch.float64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return {
        "times": {v: packed[0, k].tolist() for k, v in enumerate(VARIANTS)},
        "cpu": {v: packed[1, k].tolist() for k, v in enumerate(VARIANTS)},
        "losses": losses,
        "plan": plan.model_dump(mode="json") if rank == 0 else None,
        "plan_s": plan_s,
        "comms": comms,
    }


# --------------------------------------------------------------------------- parent


def _print_table(times: dict, med: dict, cpu: dict, predicted: dict) -> None:
    """Measured vs predicted per variant: wall median (and min, the least disturbed step),
    CPU-time median, the prediction (with its compute / communication split) and the
    ratios measured/predicted (target: within 25%, i.e. 0.8-1.25)."""
    print("# wall = step wall time (max over ranks); cpu = the rank's process CPU time for the step"
          " (max over ranks): less sensitive to other jobs on the 2 cores")
    print("# pred = cost model (cpu-gloo), comp/comm its compute and communication parts;"
          " ratios are measured / predicted")
    print(f"{'variant':<22} {'median s':>9} {'min s':>7} {'max s':>7} {'n':>3} {'cpu med s':>9} "
          f"{'pred s':>7} {'comp':>6} {'comm':>6} {'wall/pred':>9} {'min/pred':>8} {'cpu/pred':>8}")
    for v in VARIANTS:
        est = predicted.get(v)
        if est is None:
            cells = f"{'-':>7} {'-':>6} {'-':>6} {'-':>9} {'-':>8} {'-':>8}"
        else:
            pred = est.step_time_s
            cells = (f"{pred:>7.4f} {est.compute_time_s:>6.3f} {est.comm_time_s:>6.3f} {med[v] / pred:>9.2f} "
                     f"{min(times[v]) / pred:>8.2f} {cpu[v] / pred:>8.2f}")
        print(f"{v + ' ' + NAMES[v]:<22} {med[v]:>9.4f} {min(times[v]):>7.4f} {max(times[v]):>7.4f} "
              f"{len(times[v]):>3} {cpu[v]:>9.4f} {cells}")


def _predicted(cfg, args_dict: dict) -> dict[str, object]:
    """The cost model's estimate (cpu-gloo profile) for each variant's styles, or None."""
    import shardplan

    from plan_quality import NO_SP, TORCHTITAN  # the same style tables as the pricing benchmark

    model = build_model(cfg, device="meta")
    inputs = (torch.empty(args_dict["batch"], args_dict["seq"], dtype=torch.long, device="meta"),)
    common = dict(example_inputs=inputs, hardware="cpu-gloo")
    out: dict[str, object] = {}
    for v, call in (
        ("A", lambda: shardplan.plan_model(model, {"tp": 2}, explain=False, **common)),
        ("B", lambda: shardplan.price_styles(model, {"tp": 2}, TORCHTITAN, **common)),
        ("C", lambda: shardplan.price_styles(model, {"tp": 2}, NO_SP, sequence_parallel=False, **common)),
    ):
        try:
            out[v] = call().estimate
        except Exception as exc:  # pricing is informative only; never fail the measurement
            print(f"# pricing {v} failed: {type(exc).__name__}: {exc}")
            out[v] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (>= 12)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--multiple-of", type=int, default=256, help="ffn hidden = 8/3*dim rounded up to this")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    args_dict = {k.replace("-", "_"): v for k, v in vars(args).items()}
    args_dict["kv_heads"] = args.kv_heads
    args_dict["multiple_of"] = args.multiple_of

    from shardplan.tools.launch import run_on_gloo

    cfg = make_config(args_dict)
    n_params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    print(f"# step_time: {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, 2 gloo ranks x 1 thread, fp32")
    print(f"# Llama dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} "
          f"ffn={cfg.ffn_hidden_dim} vocab={cfg.vocab_size} ({n_params / 1e6:.1f}M params); "
          f"batch {args.batch} x seq {args.seq}; AdamW(foreach=True)")
    from _machine import speed_note

    print(f"# machine at start: {speed_note()}")
    started = time.perf_counter()
    results = run_on_gloo(worker, world_size=2, args=(args_dict,), timeout_s=args.timeout, num_threads=1)
    wall = time.perf_counter() - started
    r0 = results[0]
    times = r0["times"]
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    predicted = _predicted(cfg, args_dict)

    plan = r0["plan"]
    print(f"# auto plan (planned in {r0['plan_s']:.2f} s on rank 0, hardware cpu-gloo):")
    for rule in plan["rules"]:
        lay = ", ".join(f"{k}={rule[k]}" for k in ("input_layouts", "output_layouts") if rule[k])
        print(f"#   {rule['module']:<28} {rule['style']}{f' ({lay})' if lay else ''}")
    for region in plan["regions"]:
        print(f"#   region {region['module']:<21} input {region['input']}: "
              f"{region['input_layouts']} -> {region['desired_input_layouts']}")
    uses_sp = any(r["style"] == "sequence_parallel" for r in plan["rules"])
    print(f"# auto plan uses sequence parallel at this size: {'yes' if uses_sp else 'no'}")
    print()
    cpu = {v: statistics.median(r0["cpu"][v]) for v in VARIANTS}
    _print_table(times, med, cpu, predicted)
    print("collectives per step (CommDebugMode, rank 0): " + "; ".join(
        f"{v} " + ", ".join(f"{k} {n}" for k, n in sorted(r0["comms"][v].items())) for v in VARIANTS))
    best_hand = min(("B", "C"), key=lambda v: med[v])
    print()
    print(f"A/B (auto / torchtitan SP)      = {med['A'] / med['B']:.3f}")
    print(f"A/C (auto / torchtitan no SP)   = {med['A'] / med['C']:.3f}")
    ok = med["A"] / med[best_hand] <= 1.05
    print(f"A/best hand plan ({best_hand})      = {med['A'] / med[best_hand]:.3f}   target <= 1.05: "
          f"{'met' if ok else 'NOT met'}")
    # paired per-step ratios are less sensitive to slow drifts in machine load
    paired = {h: statistics.median(a / b for a, b in zip(times["A"], times[h])) for h in ("B", "C")}
    print(f"median of paired per-step ratios: A/B {paired['B']:.3f}, A/C {paired['C']:.3f}")
    print(f"CPU-time medians: A/B {cpu['A'] / cpu['B']:.3f}, A/C {cpu['A'] / cpu['C']:.3f}")
    losses = r0["losses"]
    diffs = {h: max(abs(a - b) for a, b in zip(losses["A"], losses[h])) for h in ("B", "C")}
    print("loss step 1 / last: " + ", ".join(
        f"{v} {losses[v][0]:.4f}/{losses[v][-1]:.4f}" for v in VARIANTS))
    print(f"max |loss A - loss B| = {diffs['B']:.2e}, max |loss A - loss C| = {diffs['C']:.2e} "
          f"over {len(losses['A'])} steps (first untimed)")
    print(f"# wall time of the gloo run: {wall:.1f} s")
    print(f"# machine at end: {speed_note()}")


if __name__ == "__main__":
    main()
