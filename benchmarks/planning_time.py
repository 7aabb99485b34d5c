"""Planning time: how long shardplan takes to plan Llama 3 8B / 70B / 405B.

(a) End to end, in a fresh subprocess each time (interpreter start, imports, building the
    meta model, tracing, solving, writing the plan):
        python -m shardplan plan <preset> --mesh dp=16,tp=8 --format json
    median of 3 per model, the models alternating round by round. If the CLI does not run,
    a ``python -c`` fallback does the same through the API (build_preset + plan_model +
    plan.to_json()) and the table says so. A row for ``python -c "import shardplan.cli"``
    shows how much of that is start-up. The child's peak RSS comes from ``os.wait4``
    (the kernel's rusage of that child: ``getrusage(RUSAGE_SELF)`` at its exit); plan size
    is the number of rules in the printed JSON.
(b) ``shardplan.plan_model`` alone, in this process, on already built meta models
    (llama3-8b and llama3-405b, mesh dp=16,tp=8), median of 5, explain=True and
    explain=False alternating, after one untimed warm-up call per model.
(c) time(405B) / time(8B) for both.

Targets: 405B end to end < 6 s; plan_model on a built 405B < 1.5 s; ratio 405B/8B < 2.

Usage (from the repo root)::

    python benchmarks/planning_time.py [--runs 3] [--reps 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")
MESH = {"dp": 16, "tp": 8}
MESH_ARG = "dp=16,tp=8"

FALLBACK = (
    "import sys, shardplan\n"
    "from shardplan.models import build_preset\n"
    "model = build_preset(sys.argv[1])\n"
    "plan = shardplan.plan_model(model, {'dp': 16, 'tp': 8})\n"
    "print(plan.to_json())\n"
)


# One instrumented child per round for the 405B: where the end-to-end time goes. It plans
# the way the CLI does (the preset's example inputs, batch 2 x seq 2048; explain=True).
PHASES = (
    "import time, json, sys\n"
    "t0 = time.perf_counter()\n"
    "import shardplan\n"
    "from shardplan.models import PRESETS, build_preset\n"
    "t1 = time.perf_counter()\n"
    "model = build_preset(sys.argv[1])\n"
    "t2 = time.perf_counter()\n"
    "plan = shardplan.plan_model(model, {'dp': 16, 'tp': 8}, example_inputs=PRESETS[sys.argv[1]].example_inputs(device='meta'))\n"
    "t3 = time.perf_counter()\n"
    "text = plan.to_json()\n"
    "t4 = time.perf_counter()\n"
    "print(json.dumps({'import': t1 - t0, 'build': t2 - t1, 'plan': t3 - t2, 'to_json': t4 - t3}))\n"
)


def _cli_cmd(name: str) -> list[str]:
    return [sys.executable, "-m", "shardplan", "plan", name, "--mesh", MESH_ARG, "--format", "json"]


def _fallback_cmd(name: str) -> list[str]:
    return [sys.executable, "-c", FALLBACK, name]


def run_child(cmd: list[str]) -> dict:
    """Run ``cmd`` from the repo root; wall seconds, peak RSS (bytes), stdout, exit code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "wall": wall, "rss": usage.ru_maxrss * 1024,  # Linux reports KiB
            "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace"),
            "rc": proc.returncode,
        }


def _rules(stdout: str) -> int | None:
    try:
        return len(json.loads(stdout)["rules"])
    except (ValueError, KeyError, TypeError):
        return None


def end_to_end(runs: int) -> tuple[dict, str]:
    probe = run_child(_cli_cmd("llama3-debug"))
    use_cli = probe["rc"] == 0 and _rules(probe["stdout"]) is not None
    how = "python -m shardplan plan <model> --mesh dp=16,tp=8 --format json"
    if not use_cli:
        how = ("FALLBACK python -c (build_preset + plan_model + to_json): `python -m shardplan plan` failed: "
               + (probe["stderr"].strip().splitlines() or ["?"])[-1])
    make = _cli_cmd if use_cli else _fallback_cmd
    rows: dict[str, list[dict]] = {name: [] for name in ("startup", *MODELS, "phases")}
    for _ in range(runs):
        rows["startup"].append(run_child([sys.executable, "-c", "import shardplan.cli, shardplan.models"]))
        rows["phases"].append(run_child([sys.executable, "-c", PHASES, "llama3-405b"]))
        for name in MODELS:  # alternate the models inside each round
            res = run_child(make(name))
            if res["rc"] != 0:
                raise SystemExit(f"{' '.join(make(name))} failed ({res['rc']}):\n{res['stderr'][-2000:]}")
            rows[name].append(res)
    return rows, how


def plan_model_times(reps: int) -> dict[tuple[str, bool], list[float]]:
    import shardplan
    from shardplan.models import build_preset

    built = {name: build_preset(name) for name in ("llama3-8b", "llama3-405b")}
    for model in built.values():
        shardplan.plan_model(model, MESH, explain=True)  # warm-up: lazy imports, caches
    times: dict[tuple[str, bool], list[float]] = {(n, e): [] for n in built for e in (True, False)}
    for _ in range(reps):
        for name, model in built.items():
            for explain in (True, False):
                t0 = time.perf_counter()
                shardplan.plan_model(model, MESH, explain=explain)
                times[(name, explain)].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="end-to-end runs per model")
    parser.add_argument("--reps", type=int, default=5, help="plan_model repetitions per setting")
    args = parser.parse_args()

    import torch

    print(f"# planning_time: {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    from _machine import speed_note

    print(f"# machine at start: {speed_note()}")
    started = time.perf_counter()
    rows, how = end_to_end(args.runs)
    print(f"# (a) end to end, fresh process each run, median of {args.runs}: {how}")
    print(f"{'model':<28} {'median s':>9} {'min s':>7} {'max s':>7} {'peak RSS':>10} {'rules':>6} {'JSON':>9} {'target':>10}")
    e2e = {}
    phases = rows.pop("phases")
    for name, res in rows.items():
        walls = [r["wall"] for r in res]
        e2e[name] = statistics.median(walls)
        rss = max(r["rss"] for r in res)
        label = "startup (import only)" if name == "startup" else name
        rules = "" if name == "startup" else str(_rules(res[0]["stdout"]))
        size = "" if name == "startup" else f"{len(res[0]['stdout']) / 1024:.1f} KiB"
        target = ""
        if name == "llama3-405b":
            target = f"< 6 s {'ok' if e2e[name] < 6 else 'MISS'}"
        print(f"{label:<28} {e2e[name]:>9.2f} {min(walls):>7.2f} {max(walls):>7.2f} "
              f"{rss / 2**20:>6.0f} MiB {rules:>6} {size:>9} {target:>10}")

    try:
        split = [json.loads(r["stdout"].strip().splitlines()[-1]) for r in phases]
        parts = ", ".join(f"{k} {statistics.median(d[k] for d in split):.2f} s" for k in split[0])
        print(f"# 405B in a fresh process, median per phase (API, as the CLI plans it): {parts}")
    except (ValueError, IndexError, KeyError):
        print(f"# 405B phase breakdown failed: {phases[0]['stderr'][-500:]}")

    times = plan_model_times(args.reps)
    print()
    print(f"# (b) plan_model alone on a built meta model, mesh {MESH_ARG}, median of {args.reps}, in this process")
    print(f"{'model':<14} {'explain':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'target':>13}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for (name, explain), ts in times.items():
        target = ""
        if name == "llama3-405b":
            target = f"< 1.5 s {'ok' if med[(name, explain)] < 1.5 else 'MISS'}"
        print(f"{name:<14} {str(explain):<8} {med[(name, explain)]:>9.3f} {min(ts):>7.3f} {max(ts):>7.3f} {target:>13}")

    print()
    print("# (c) time(405B) / time(8B), target < 2")
    ratios = {
        "end to end (subprocess)": e2e["llama3-405b"] / e2e["llama3-8b"],
        "end to end minus start-up": (e2e["llama3-405b"] - e2e["startup"]) / max(e2e["llama3-8b"] - e2e["startup"], 1e-9),
        "plan_model, explain=True": med[("llama3-405b", True)] / med[("llama3-8b", True)],
        "plan_model, explain=False": med[("llama3-405b", False)] / med[("llama3-8b", False)],
    }
    for label, r in ratios.items():
        print(f"{label:<28} {r:>6.2f}  {'ok' if r < 2 else 'MISS'}")
    print(f"# elapsed {time.perf_counter() - started:.1f} s")
    print(f"# machine at end: {speed_note()}")


if __name__ == "__main__":
    main()
