"""Expert parallelism against tensor parallelism inside the experts, in the cost model, at full size.

For each MoE transformers type (``--types``), built from its default config at FULL size on
the meta device (``hf:<type>``, nothing downloaded), and mistral's reference Mixtral 8x7B
layer (experts as an ``nn.ModuleList``, ``mixtral_8x7b``), bf16, h100-nvlink, batch 2 x seq
2048 per data rank, plans on the same number of GPUs:

* 64 GPUs: ``dp=8,tp=8`` (experts split inside, ``moe_tp_experts``), ``dp=8,ep=8`` and
  ``ep=64`` (whole experts over ep, every other module data parallel; when ep divides E),
  ``ep=8,tp=8`` (whole experts over ep, each split inside over tp as the cost model chose,
  attention split by heads over tp);
* 8 GPUs: ``tp=8`` against ``ep=8``.

Columns: ``step ms`` (predicted training step), ``samples/s`` (data ranks x batch / step:
an ep rank is a data rank for everything but its experts, so the meshes train on different
global batches per step and only this column compares them), ``x tp`` (samples/s over the
tensor-parallel mesh's on as many GPUs), ``params/dev`` and ``peak/dev`` (GiB; peak includes
activations, Korthikanti without recomputation, which at tp=1 are not divided: an ep mesh that
does not ``fit`` the H100's memory needs activation checkpointing or a smaller batch first),
``sent/dev`` (bytes each device sends per
step, all collectives), ``a2a`` (all-to-alls per step). Uniform routing is the cost model's
assumption. One table, from one run.

Usage (repository root): ``python benchmarks/expert_parallel.py [--types mixtral,qwen3_moe]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import speed_note  # noqa: E402

# a ``module:function`` builds a model that is not a transformers type: mistral's reference
# Mixtral 8x7B, its experts an nn.ModuleList called in a loop (split over ep by record and replay)
TYPES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "tests.portability.listed_experts:mixtral_8x7b"]
MESHES = ({"dp": 8, "tp": 8}, {"dp": 8, "ep": 8}, {"ep": 8, "tp": 8}, {"ep": 64}, {"tp": 8}, {"ep": 8})
GIB = 2**30


def _data_ranks(mesh: dict) -> int:
    out = 1
    for axis, n in mesh.items():
        out *= n if axis != "tp" else 1
    return out


def measure(model_type: str) -> list[dict]:
    import shardplan
    from shardplan.decide.cost import get_hardware
    from shardplan.tools.sources import resolve_model

    import torch

    model, inputs, _ = resolve_model(model_type if ":" in model_type else f"hf:{model_type}")
    if inputs is None:  # a builder's model: token ids for its embedding, 2 x 2048
        vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
        inputs = (torch.randint(0, vocab, (2, 2048), generator=torch.Generator().manual_seed(0)),)
    model_type = model_type.rpartition(":")[2]
    rows = []
    for mesh in MESHES:
        row = {"type": model_type, "mesh": ",".join(f"{k}={v}" for k, v in mesh.items()), "gpus": _prod(mesh)}
        try:
            plan = shardplan.plan_model(model, mesh, example_inputs=inputs, dtype="bf16", explain=False)
        except Exception as exc:  # noqa: BLE001 - a row of the table
            row["error"] = str(exc).splitlines()[0][:110]
            rows.append(row)
            continue
        e = plan.estimate
        limit = get_hardware(plan.options.hardware).memory_bytes
        row |= {"step": e.step_time_s, "samples": _data_ranks(mesh) * inputs[0].shape[0] / e.step_time_s,
                "fits": e.peak_memory_bytes <= limit,
                "params": e.param_bytes_per_device / GIB, "peak": e.peak_memory_bytes / GIB,
                "sent": e.comm_bytes_per_step / GIB,
                "a2a": sum(e.collectives[p].all_to_all for p in ("forward", "backward") if p in e.collectives)}
        rows.append(row)
    for row in rows:
        tp = next((r for r in rows if r["gpus"] == row["gpus"] and "tp=" in r["mesh"] and "ep=" not in r["mesh"]
               and "samples" in r), None)
        if tp is not None and "samples" in row:
            row["x tp"] = row["samples"] / tp["samples"]
    return rows


def _prod(mesh: dict) -> int:
    out = 1
    for n in mesh.values():
        out *= n
    return out


def _fmt(row: dict) -> str:
    head = f"{row['type'][:12]:<12} {row['mesh']:<10} {row['gpus']:4d}"
    if "error" in row:
        return f"{head}  refused: {row['error']}"
    return (f"{head} {row['step'] * 1e3:9.1f} {row['samples']:9.1f} {row.get('x tp', float('nan')):6.2f} "
            f"{row['params']:10.2f} {row['peak']:9.2f} {'yes' if row['fits'] else 'no':>4} {row['sent']:9.2f} {row['a2a']:5d}")


HEADER = (f"{'type':<12} {'mesh':<10} {'gpus':>4} {'step ms':>9} {'samples/s':>9} {'x tp':>6} {'params/dev':>10} "
          f"{'peak/dev':>9} {'fits':>4} {'sent/dev':>9} {'a2a':>5}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    print(f"# expert parallel: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {speed_note()}")
    print("# full size on meta, bf16, h100-nvlink, batch 2 x seq 2048 per data rank; GiB per device; uniform routing")
    print(HEADER)
    for model_type in args.types.split(","):
        try:
            rows = measure(model_type)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"{model_type:<12} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
            continue
        for row in rows:
            print(_fmt(row), flush=True)
    print(f"# machine at end: {speed_note()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
