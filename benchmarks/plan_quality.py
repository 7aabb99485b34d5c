"""Plan quality: the auto plan vs torchtitan's hand-written Llama plan, one cost model.

For llama3-8b, llama3-70b and llama3-405b (meta models, bf16) at tp = 2, 4, 8 on the
``h100-nvlink`` profile, three plans are priced by shardplan's own estimator:

* auto     ``shardplan.plan_model(model, {"tp": tp}, explain=False)``
* tt-sp    torchtitan's plan (``TORCHTITAN`` below), pinned with ``shardplan.price_styles``
* tt-nosp  the same per-Linear plan without sequence parallel (``NO_SP``, norms replicated),
           for reference

and for each the predicted step time, the bytes each device sends per step, the
parameter bytes per device and the collectives per step are printed, with the ratios
auto/tt-sp (target <= 1.0) and a check that parameter bytes per device are within 1% of
(total parameter bytes)/tp. Everything runs twice: at plan_model's default batch
(batch 2 x seq 2048) and at batch 8, to show whether the sequence-parallel decision
changes with activation size.

These are predictions of one model, not measurements: auto <= torchtitan here says the
optimizer finds the optimum *of its own cost model*; step_time.py checks real steps.

Usage (from the repo root)::

    python benchmarks/plan_quality.py [--models llama3-8b,...] [--tps 2,4,8] [--batches default,8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torchtitan's Llama 3 tensor-parallel plan, from pytorch/torchtitan
# torchtitan/models/llama3/infra/parallelize.py, apply_tp() (checked against commit
# 018740b7aae7846d24954539244c78215dbd181f), with loss_parallel=False and no float8:
#   "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
#   "norm": SequenceParallel()
#   "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
#   per block:
#   "attention_norm": SequenceParallel()
#   "attention": PrepareModuleInput(input_layouts=(Shard(1), None, ...), desired_input_layouts=(Replicate(), None, ...))
#   "attention.wq"/"wk"/"wv": ColwiseParallel()
#   "attention.wo": RowwiseParallel(output_layouts=Shard(1))
#   "ffn_norm": SequenceParallel()
#   "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
#   "feed_forward.w1"/"w3": ColwiseParallel();  "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))
# In shardplan's vocabulary the PrepareModuleInput from Shard(1) is the colwise Linears'
# input layout ("input": "S1"); the planner groups wq/wk/wv (w1/w3) into one region itself.
TORCHTITAN: dict[str, str | tuple[str, dict[str, str]]] = {
    "tok_embeddings": ("embedding_rowwise", {"output": "S1"}),
    "layers.*.attention_norm": "sequence_parallel",
    "layers.*.ffn_norm": "sequence_parallel",
    "norm": "sequence_parallel",
    "layers.*.attention.w[qkv]": ("colwise", {"input": "S1"}),
    "layers.*.feed_forward.w[13]": ("colwise", {"input": "S1"}),
    "layers.*.attention.wo": ("rowwise", {"output": "S1"}),
    "layers.*.feed_forward.w2": ("rowwise", {"output": "S1"}),
    "output": ("colwise_gather_output", {"input": "S1"}),
}

# The same per-Linear plan without sequence parallel (Megatron-style TP, norms replicated).
# Priced with sequence_parallel=False, so the style names alone pin Replicate layouts.
NO_SP: dict[str, str | tuple[str, dict[str, str]]] = {
    "tok_embeddings": "embedding_rowwise",
    "layers.*.attention_norm": "replicate",
    "layers.*.ffn_norm": "replicate",
    "norm": "replicate",
    "layers.*.attention.w[qkv]": "colwise",
    "layers.*.feed_forward.w[13]": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "colwise_gather_output",
}

HARDWARE = "h100-nvlink"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_time(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.2f} ms"


def _collectives(est) -> str:
    """Per step, forward + backward: ar all-reduce, ag all-gather, rs reduce-scatter."""
    tot = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    for phase in est.collectives.values():
        for k in tot:
            tot[k] += getattr(phase, k)
    out = f"ar{tot['all_reduce']} ag{tot['all_gather']} rs{tot['reduce_scatter']}"
    return out + (f" a2a{tot['all_to_all']}" if tot["all_to_all"] else "")


def _uses_sp(plan) -> bool:
    return any(r.style == "sequence_parallel" for r in plan.rules)


def price_three(model, tp: int, batch: int | None) -> dict:
    import shardplan

    kw = {"hardware": HARDWARE}
    if batch is not None:
        kw["batch_size"] = batch
    t0 = time.perf_counter()
    plans = {
        "auto": shardplan.plan_model(model, {"tp": tp}, explain=False, **kw),
        "tt-sp": shardplan.price_styles(model, {"tp": tp}, TORCHTITAN, **kw),
        "tt-nosp": shardplan.price_styles(model, {"tp": tp}, NO_SP, sequence_parallel=False, **kw),
    }
    return {"plans": plans, "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    parser.add_argument("--tps", default="2,4,8")
    parser.add_argument("--batches", default="default,8", help="'default' = plan_model's default batch")
    args = parser.parse_args()

    import torch

    from shardplan.models import build_preset

    models = args.models.split(",")
    tps = [int(t) for t in args.tps.split(",")]
    batches = [None if b == "default" else int(b) for b in args.batches.split(",")]
    print(f"# plan_quality: {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
          f"hardware profile {HARDWARE}, predicted figures (shardplan cost model)")
    print("# time = predicted step time; sent = bytes each device sends per step; "
          "params = parameter bytes per device;")
    print("# peak mem = predicted peak per device (params + grads + AdamW state + saved activations)")
    print("# colls = collectives per step (fwd+bwd): ar all-reduce, ag all-gather, rs reduce-scatter")
    from _machine import speed_note

    print(f"# machine at start: {speed_note()}")
    started = time.perf_counter()
    failures: list[str] = []
    decisions: list[tuple] = []
    for batch in batches:
        print()
        print(f"## batch = {'default' if batch is None else batch}")
        header = (f"{'model':<12} {'tp':>2} {'plan':<8} {'SP':<3} {'time':>10} {'sent':>10} {'params':>10} "
                  f"{'peak mem':>10} {'colls':<18} {'time/tt':>7} {'sent/tt':>7} {'params/(total/tp)':>17}")
        print(header)
        for name in models:
            model = build_preset(name)
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            for tp in tps:
                try:
                    res = price_three(model, tp, batch)
                except Exception as exc:
                    failures.append(f"{name} tp={tp} batch={batch}: {type(exc).__name__}: {exc}")
                    print(f"{name:<12} {tp:>2} FAILED: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                plans = res["plans"]
                tt = plans["tt-sp"].estimate
                shape = f"{plans['auto'].options.batch_size}x{plans['auto'].options.seq_len}"
                for label, plan in plans.items():
                    e = plan.estimate
                    share = e.param_bytes_per_device / (total / tp)
                    print(f"{name if label == 'auto' else '':<12} {tp if label == 'auto' else '':>2} {label:<8} "
                          f"{'yes' if _uses_sp(plan) else 'no':<3} {_fmt_time(e.step_time_s):>10} "
                          f"{_fmt_bytes(e.comm_bytes_per_step):>10} {_fmt_bytes(e.param_bytes_per_device):>10} "
                          f"{_fmt_bytes(e.peak_memory_bytes):>10} "
                          f"{_collectives(e):<18} {e.step_time_s / tt.step_time_s:>7.3f} "
                          f"{e.comm_bytes_per_step / tt.comm_bytes_per_step:>7.3f} "
                          f"{share:>9.4f} {'ok' if abs(share - 1) <= 0.01 else 'OFF':>4}")
                    if abs(share - 1) > 0.01:
                        failures.append(f"{name} tp={tp} batch={batch} {label}: params/device {share:.4f} x total/tp")
                a = plans["auto"].estimate
                if a.step_time_s > tt.step_time_s * (1 + 1e-9):
                    failures.append(f"{name} tp={tp} batch={batch}: auto predicted slower than torchtitan "
                                    f"({a.step_time_s / tt.step_time_s:.3f})")
                decisions.append((name, tp, batch, shape, _uses_sp(plans["auto"]), res["seconds"]))

    print()
    print("## sequence-parallel decision of the auto plan (batch x seq as planned)")
    print(f"{'model':<12} {'tp':>2} " + " ".join(f"{'batch ' + ('default' if b is None else str(b)):>14}" for b in batches))
    for name in models:
        for tp in tps:
            cells = []
            for b in batches:
                hit = next((d for d in decisions if d[:3] == (name, tp, b)), None)
                cells.append(f"{('SP' if hit[4] else 'no SP') + ' @' + hit[3] if hit else '-':>14}")
            print(f"{name:<12} {tp:>2} " + " ".join(cells))
    print()
    print("targets: auto/torchtitan time <= 1.0 and sent bytes <= 1.0; params within 1% of total/tp")
    if failures:
        print("MISSED:")
        for f in failures:
            print(f"  {f}")
    else:
        print("all targets met")
    print(f"# elapsed {time.perf_counter() - started:.1f} s (three plans per row group)")
    print(f"# machine at end: {speed_note()}")


if __name__ == "__main__":
    main()
