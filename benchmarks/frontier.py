"""Frontier architectures at full size: how well shardplan splits them, against Hugging Face's own plan.

For each transformers model type (``--types``; default the 12 of issue 10), built from its
default config at FULL size on the meta device, in the config's own dtype (``hf:<type>``,
nothing downloaded), at tp=8 and at dp=8 x tp=8:

* ``eff``: total parameter bytes / (tp x parameter bytes per device); 1.000 is a model
  really split tp ways (the data axis does not change it: FSDP's division is on top);
* ``gathered``: weight modules whose output is all-gathered (the plan's warnings);
* ``rules``: rules in the plan file (folded patterns);
* ``coll/layer``: tp collectives of one forward + backward per decoder layer (the data-flow
  minimum of a dense or MoE transformer block is 4: two forward, two backward);
* ``step``: the predicted step time (h100-nvlink, batch 2 x seq 2048);
* ``hf eff`` / ``hf step``: the same model with Hugging Face's ``base_model_tp_plan`` (and
  the head's ``_tp_plan``) pinned, priced by the same cost model
  (``shardplan.interop.hf.from_hf_tp_plan``, unsupported entries left replicated);
  ``step/hf`` below 1 is shardplan faster;
* ``wall``: ``python -m shardplan plan hf:<type> --mesh tp=8 --format json`` end to end in
  a fresh process (import, build, trace, plan, explain), seconds, median of ``--runs``.

Usage (repository root): ``python benchmarks/frontier.py [--types llama,qwen3] [--runs 1]``.
One table, from one run; failures are rows with the error. ~5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import speed_note  # noqa: E402

TYPES = ["llama", "qwen3", "mistral", "mixtral", "gemma3_text", "phi3", "qwen3_moe", "deepseek_v3",
         "llama4_text", "gpt_oss", "glm4_moe", "qwen3_next"]
MESHES = ({"tp": 8}, {"dp": 8, "tp": 8})


def _wall(model_type: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardplan", "plan", f"hf:{model_type}", "--mesh", "tp=8", "--format", "json"],
                       check=True, capture_output=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(plan, total_bytes: float, tp: int, layers: int) -> dict:
    e = plan.estimate
    coll = sum(v for phase in ("forward", "backward") for v in e.collectives[phase].model_dump().values())
    return {
        "eff": total_bytes / (tp * e.param_bytes_per_device),
        "gathered": sum("output all-gathered" in w for w in plan.warnings),
        "rules": len(plan.rules),
        "coll/layer": coll / max(layers, 1),
        "step": e.step_time_s,
    }


def measure(model_type: str, runs: int) -> list[dict]:
    import shardplan
    from shardplan.interop.hf import from_hf_tp_plan, hf_tp_plan
    from shardplan.tools.sources import resolve_model

    model, inputs, _ = resolve_model(f"hf:{model_type}")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = getattr(model.config, "num_hidden_layers", 1)
    hf_styles = hf_tp_plan(model)
    rows = []
    for mesh in MESHES:
        t0 = time.perf_counter()
        plan = shardplan.plan_model(model, mesh, example_inputs=inputs)
        row = {"type": model_type, "mesh": ",".join(f"{k}={v}" for k, v in mesh.items()),
               "params": sum(p.numel() for p in model.parameters()), "plan_s": time.perf_counter() - t0,
               **_row(plan, total, mesh["tp"], layers)}
        try:
            hf = from_hf_tp_plan(hf_styles, model=model, mesh=mesh, example_inputs=inputs, skip_unsupported=True)
            row |= {"hf eff": total / (mesh["tp"] * hf.estimate.param_bytes_per_device), "hf step": hf.estimate.step_time_s}
        except Exception as exc:  # noqa: BLE001 - a row of the table, not a crash of the benchmark
            row["hf error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
    rows[0]["wall"] = _wall(model_type, runs)
    return rows


def _fmt(row: dict) -> str:
    step_ratio = row["step"] / row["hf step"] if row.get("hf step") else None
    cells = [
        f"{row['type']:<12}", f"{row['mesh']:<9}", f"{row['params'] / 1e9:7.1f}B", f"{row['eff']:6.3f}",
        f"{row['gathered']:4d}", f"{row['rules']:5d}", f"{row['coll/layer']:6.1f}", f"{row['step'] * 1e3:9.1f}",
        f"{row['hf eff']:7.3f}" if "hf eff" in row else f"{'-':>7}",
        f"{row['hf step'] * 1e3:9.1f}" if "hf step" in row else f"{'-':>9}",
        f"{step_ratio:7.3f}" if step_ratio else f"{'-':>7}",
        f"{row['plan_s']:6.2f}", f"{row['wall']:6.2f}" if "wall" in row else f"{'':>6}",
    ]
    return " ".join(cells) + (f"  hf: {row['hf error']}" if "hf error" in row else "")


HEADER = (f"{'type':<12} {'mesh':<9} {'params':>8} {'eff':>6} {'gath':>4} {'rules':>5} {'coll/L':>6} {'step ms':>9} "
          f"{'hf eff':>7} {'hf ms':>9} {'step/hf':>7} {'plan s':>6} {'wall s':>6}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--runs", type=int, default=1, help="end-to-end CLI runs per type (median)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the local check runs MoE routing on fake tensors; torch logs each op it cannot run there
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    print(f"# frontier: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {speed_note()}")
    print("# plans at full size on meta, config dtype, h100-nvlink, batch 2 x seq 2048; hf = Hugging Face's tp_plan priced alike")
    print(HEADER)
    worse = []
    for model_type in args.types.split(","):
        try:
            rows = measure(model_type, args.runs)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"{model_type:<12} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
            continue
        for row in rows:
            print(_fmt(row), flush=True)
            if row.get("hf step") and row["step"] > row["hf step"] * 1.0001:
                worse.append(f"{row['type']} {row['mesh']}")
    print(f"# shardplan's predicted step slower than HF's plan in: {', '.join(worse) or 'none'}")
    print(f"# machine at end: {speed_note()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
