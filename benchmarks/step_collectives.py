"""Collectives of one whole training step (forward, backward, clip_grad_norm_, AdamW), counted.

A 4-layer Llama (dim 64, 8 query / 4 kv heads, vocab 512) planned with sequence parallel at
tp=4, applied on the fake process group, then ``to_empty`` (the meta-build path, which swaps
every parameter), stepped with 1, 2 and 4 micro-batches of gradient accumulation (the
reduction deferred with ``shardplan.set_requires_gradient_sync`` for all but the last).
``CommDebugMode`` counts every collective, and the plan's estimate per forward and backward
is printed beside it. Runs in seconds; to compare with an older tree, run it with that tree
first on ``PYTHONPATH`` (a tree without ``set_requires_gradient_sync`` reduces every micro-batch).

    python benchmarks/step_collectives.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import shardplan  # noqa: E402
from shardplan.apply.mesh import fake_process_group, make_mesh  # noqa: E402
from shardplan.models.llama import LlamaConfig, Transformer  # noqa: E402

TP, LAYERS = 4, 4


def _count(fn) -> int:
    with CommDebugMode() as mode:
        fn()
    return sum(mode.get_comm_counts().values())


def step(micro_batches: int) -> tuple[dict[str, int], dict]:
    cfg = LlamaConfig(dim=64, n_layers=LAYERS, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=32, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": TP}, example_inputs=(ids,), explain=False, sequence_parallel=True)
    sync = getattr(shardplan, "set_requires_gradient_sync", None)
    with fake_process_group(TP):
        shardplan.apply_plan(model, make_mesh({"tp": TP}), plan)
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        counts = {"fwd+bwd": 0}
        for i in range(micro_batches):
            if sync is not None:
                sync(model, i == micro_batches - 1)
            counts["fwd+bwd"] += _count(lambda: model(x).float().sum().backward())
        counts["clip"] = _count(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True))
        counts["adamw"] = _count(opt.step)
    return counts, {p: plan.estimate.collectives[p].model_dump() for p in ("forward", "backward")}


def main() -> int:
    warnings.filterwarnings("ignore")
    print(f"# {LAYERS}-layer Llama, sequence parallel, tp={TP}, fake group, after to_empty")
    print(f"{'micro-batches':>13} {'fwd+bwd':>8} {'clip':>5} {'adamw':>6} {'total':>6}")
    for m in (1, 2, 4):
        counts, est = step(m)
        print(f"{m:>13} {counts['fwd+bwd']:>8} {counts['clip']:>5} {counts['adamw']:>6} {sum(counts.values()):>6}")
    nonzero = {p: {k: v for k, v in c.items() if v} for p, c in est.items()}
    print(f"# the plan's estimate per forward {nonzero['forward']}, per backward {nonzero['backward']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
