"""``examples/train.py`` under torchrun: the training recipe of docs/training.md, end to end.

4 gloo CPU ranks on a 2x2 ``(dp, tp)`` mesh, the checked-in plan
``examples/llama3-debug.dp2-tp2.yaml`` applied with FSDP2 on ``dp``, 3 AdamW steps with
clipping and 2 micro-batches of accumulation; then a DCP checkpoint loaded at tp=4 and
unsharded. The script compares against one process itself and exits 1 on any difference;
this test also holds the checked-in plan equal to a fresh ``shardplan plan`` of it, so the
example never runs a stale plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "llama3-debug.dp2-tp2.yaml"
CHECKS = (
    "losses, 3 steps vs one process: equal (max |diff| <= 1e-05)",
    "weights after 3 steps vs one process: equal (max |diff| <= 0.001)",
    "DCP tp=2 x dp=2 -> tp=4, every model and optimizer tensor: equal (max |diff| <= 0)",
    "DCP tp=2 x dp=2 -> unsharded, every tensor: equal (max |diff| <= 0)",
)


def test_checked_in_plan_is_what_the_planner_writes(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", "llama3-debug", "--mesh", "dp=2,tp=2", "--seq", "32", "--batch", "1", "-o", str(out)]) == 0
    assert out.read_text() == PLAN.read_text(), (
        "regenerate it: python -m shardplan plan llama3-debug --mesh dp=2,tp=2 --seq 32 --batch 1 "
        "-o examples/llama3-debug.dp2-tp2.yaml --force")


def test_torchrun_training_example_matches_one_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train.py"), "--plan", str(PLAN), "--checkpoint", str(tmp_path / "ckpt")]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.splitlines() == list(CHECKS), run.stdout
