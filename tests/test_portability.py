"""A fresh clone behaves the same on any machine, in any folder, and its files round-trip.

* Plan files do not depend on the CPU's BLAS kernel: the golden plan is rewritten byte for
  byte by processes that run OpenBLAS with other kernels (``OPENBLAS_CORETYPE``).
* Source lines in messages are found when the repository sits in a folder named
  ``shardplan`` (what ``git clone`` makes).
* Every rule round-trips through a file, a root rule (``module: ''``) included, through the
  CLI's ``plan -o``, ``check``, then ``load_plan`` and ``apply_plan``.
* The CLI's help does not import torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardplan
from shardplan.cli import main
from shardplan.plan import SIGNIFICANT_DIGITS

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "plans" / "llama3-8b.tp8.yaml"


def _python(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, pythonpath: Path = ROOT) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("coretype", ["Haswell", "Prescott"])
def test_plan_file_does_not_depend_on_the_blas_kernel(coretype: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    _python(["-m", "shardplan", "plan", "llama3-8b", "--mesh", "tp=8", "-o", str(out)], cwd=tmp_path,
            env={"OPENBLAS_CORETYPE": coretype})
    assert out.read_bytes() == GOLDEN.read_bytes()


def test_estimates_are_written_with_six_significant_digits() -> None:
    text = GOLDEN.read_text()
    assert "step_time_s: 0.101697" in text  # 6 digits, the 7th rounded away
    for line in text.splitlines():
        if line.strip().startswith("step_time_s:") and "null" not in line:
            digits = line.split(":")[1].strip().lstrip("0.").replace(".", "").rstrip("0")
            assert len(digits) <= SIGNIFICANT_DIGITS, line


def test_source_lines_are_found_in_a_folder_named_shardplan(tmp_path: Path) -> None:
    clone = tmp_path / "shardplan"
    shutil.copytree(ROOT / "shardplan", clone / "shardplan", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "tests").mkdir()
    shutil.copy(Path(__file__).parent / "portability" / "heads.py", clone / "tests" / "heads.py")
    warnings = _python(["tests/heads.py"], cwd=clone, pythonpath=clone)
    assert "tests/heads.py:26 `q, k, v = (m(x).unflatten(-1, (8, self.hd))" in warnings, warnings


def test_a_root_rule_round_trips_through_plan_check_load_and_apply(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    spec, path = "tests.portability.root_param:build", tmp_path / "plan.yaml"
    assert main(["plan", spec, "--mesh", "tp=2", "-o", str(path)]) == 0
    assert "- module: ''\n" in path.read_text()
    assert main(["check", str(path), spec]) == 0
    plan = shardplan.load_plan(path)
    assert plan.module_styles() == {"": "replicate", "a": "colwise", "b": "rowwise"}
    from torch.distributed.tensor import DTensor

    from shardplan.apply.mesh import fake_process_group, make_mesh
    from tests.portability.root_param import build

    with fake_process_group(2):
        model = shardplan.apply_plan(build(), make_mesh({"tp": 2}), plan)
        assert all(isinstance(p, DTensor) for p in model.parameters())
    capsys.readouterr()


def test_help_and_version_do_not_import_torch(tmp_path: Path) -> None:
    probe = ("import sys, contextlib, io\nfrom shardplan.cli import main\n"
             "for argv in (['--help'], ['plan', '--help'], ['--version']):\n"
             "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
             "        main(argv)\n"
             "print(sorted(m for m in ('torch', 'scipy', 'numpy', 'transformers') if m in sys.modules))\n")
    assert _python(["-c", probe], cwd=tmp_path).strip() == "[]"


def test_preset_names_without_torch_are_the_presets() -> None:
    from shardplan.models import PRESET_NAMES, PRESETS

    assert PRESET_NAMES == tuple(PRESETS)


@pytest.mark.parametrize("preset", ["llama3-debug", "gpt2-debug"])
def test_a_model_built_on_cpu_gets_the_plan_it_gets_on_meta(preset: str) -> None:
    """The local check runs meta copies of the blocks; a model built on a real device hands
    them real buffers too (Llama's RoPE tables), which used to fail the check and make the
    planner gather every attention Linear. Where the weights live must not change the plan."""
    import torch

    import shardplan
    from shardplan.models.presets import build_preset

    ids = (torch.empty(2, 32, dtype=torch.long, device="meta"),)
    plans = [shardplan.plan_model(build_preset(preset, device=d, seed=0), {"tp": 2}, example_inputs=ids, explain=False)
             for d in ("meta", "cpu")]
    assert plans[1].to_yaml() == plans[0].to_yaml()
    assert not any("local shape check" in w or "whole activations" in w for w in plans[1].warnings), plans[1].warnings
