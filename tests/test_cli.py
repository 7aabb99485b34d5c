"""Command line: ``main([...])`` in-process (exit codes, stdout data, one-line errors on
stderr, never a traceback), plus one subprocess run of ``python -m shardplan --help``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardplan
from shardplan.cli import main, parse_mesh

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(err: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert lines[0].startswith("shardplan: error: ")


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tp=2 and tp=4 plans of llama3-debug, written once through the CLI."""
    d = tmp_path_factory.mktemp("plans")
    files = {"tp2": d / "tp2.yaml", "tp4": d / "tp4.yaml"}
    for key, path in files.items():
        assert main(["plan", "llama3-debug", "--mesh", f"tp={key[2:]}", "-o", str(path)]) == 0
    return files


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "llama3-debug", "--mesh", "tp=2")
    assert code == 0, err
    assert "layers.*.attention.wq" in out and "colwise" in out
    assert "64x64" in out and "32x64" in out  # global and per-device shapes of wq
    assert "step time" in out and "all_reduce" in out


def test_plan_yaml_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama3-debug", "--mesh", "tp=2", "--format", "yaml", "--no-explain")
    assert code == 0
    plan = shardplan.Plan.from_yaml(out)
    assert plan.tp == 2 and plan.rules
    code, out, _ = run(capsys, "plan", "llama3-debug", "--mesh", "dp=2,tp=2", "--format", "json", "--no-explain")
    assert code == 0
    assert json.loads(out)["mesh"]["axes"] == {"dp": 2, "tp": 2}


def test_output_file_refuses_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.yaml"
    code, out, err = run(capsys, "plan", "llama3-debug", "--mesh", "tp=2", "--no-explain", "-o", str(path))
    assert code == 0 and out == "" and str(path) in err
    assert shardplan.load_plan(path).tp == 2
    code, _, err = run(capsys, "plan", "llama3-debug", "--mesh", "tp=2", "-o", str(path))
    assert code == 2 and "--force" in err
    assert_one_error(err)
    code, _, _ = run(capsys, "plan", "llama3-debug", "--mesh", "tp=4", "--no-explain", "-o", str(path), "--force")
    assert code == 0 and shardplan.load_plan(path).tp == 4
    json_path = tmp_path / "plan.json"
    assert run(capsys, "plan", "llama3-debug", "--mesh", "tp=2", "--no-explain", "-o", str(json_path))[0] == 0
    assert json.loads(json_path.read_text())["version"] == 1


@pytest.mark.parametrize("argv", [
    ["plan", "no-such-model"],
    ["plan", "llama3-debug", "--mesh", "tp8"],
    ["plan", "llama3-debug", "--mesh", "tp=0"],
    ["plan", "llama3-debug", "--mesh", "dp=2,,tp=2"],
    ["plan", "nosuchpkg.mod:build"],
    ["plan", "llama3-debug", "--hardware", "tpu-v9"],
    ["check", "/nonexistent/plan.yaml", "llama3-debug"],
])
def test_user_errors_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert_one_error(err)


def test_parse_mesh() -> None:
    assert parse_mesh("tp=8") == {"tp": 8}
    assert parse_mesh("dp=16,tp=8") == {"dp": 16, "tp": 8}
    with pytest.raises(ValueError, match="tp=8"):
        parse_mesh("tp:8")


def test_tp_that_does_not_divide_kv_heads(capsys: pytest.CaptureFixture[str]) -> None:
    """llama3-debug has 4 kv heads: tp=8 is either refused clearly or planned validly."""
    code, out, err = run(capsys, "plan", "llama3-debug", "--mesh", "tp=8", "--format", "yaml", "--no-explain")
    assert "Traceback" not in err
    if code == 2:
        assert_one_error(err)
    else:
        assert code == 0
        assert shardplan.Plan.from_yaml(out).tp == 8


def test_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema")
    assert code == 0
    assert "properties" in json.loads(out)


def test_check(plan_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", str(plan_files["tp2"]), "llama3-debug")
    assert code == 0, out + err
    edited = tmp_path / "edited.yaml"
    text = plan_files["tp2"].read_text()
    old = shardplan.load_plan(plan_files["tp2"]).model.fingerprint
    edited.write_text(text.replace(old, "sha256:" + "0" * 32))
    code, out, err = run(capsys, "check", str(edited), "llama3-debug")
    assert code == 1
    assert "fingerprint" in out
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(text.replace("module: norm\n", "module: nrm\n"))
    code, out, _ = run(capsys, "check", str(renamed), "llama3-debug")
    assert code == 1
    assert "nrm" in out and "norm (RMSNorm)" in out  # the stray rule, and the module it left uncovered
    uneven = tmp_path / "tp3.yaml"
    uneven.write_text(text.replace("    tp: 2\n", "    tp: 3\n"))
    code, out, _ = run(capsys, "check", str(uneven), "llama3-debug")
    assert code == 1 and "tp=3 does not divide" in out


def test_check_unusable_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules: [\n")
    code, _, err = run(capsys, "check", str(bad), "llama3-debug")
    assert code == 2
    assert_one_error(err)


def test_diff(plan_files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "diff", str(plan_files["tp2"]), str(plan_files["tp4"]))
    assert code == 0
    line = next(ln for ln in out.splitlines() if "param bytes/device" in ln)
    assert "->" in line and "%" in line and "(same)" not in line
    assert "tp=2 -> tp=4" in out


def test_explain(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "explain", "llama3-debug", "layers.0.attention.wq", "--mesh", "tp=2")
    assert code == 0, err
    assert "colwise" in out and "replicate" in out and "chosen" in out


def test_simulate_counts_match(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "llama3-debug", "--mesh", "tp=2")
    assert code == 0, out + err
    assert "all_reduce" in out and "DIFFERS" not in out
    bytes_rows = [ln for ln in out.splitlines() if "logical bytes" in ln]
    assert len(bytes_rows) == 2 and all("ok" in ln for ln in bytes_rows), out  # forward and backward


def test_simulate_plan_file_counts_and_bytes(plan_files: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "llama3-debug", "--plan", str(plan_files["tp4"]))
    assert code == 0, out + err
    assert "DIFFERS" not in out
    # a plan whose byte estimate is off by one byte: counts still agree, bytes do not
    plan = shardplan.load_plan(plan_files["tp4"])
    forward = plan.estimate.collective_bytes["forward"]
    plan.estimate.collective_bytes["forward"] = forward + 1
    off = tmp_path / "off_by_one.yaml"
    plan.save(off)
    code, out, err = run(capsys, "simulate", "llama3-debug", "--plan", str(off))
    assert code == 1, out + err
    row = next(ln for ln in out.splitlines() if "forward" in ln and "logical bytes" in ln)
    assert "DIFFERS" in row and f"{forward + 1:,.0f}" in row and f"{forward:,.0f}" in row
    assert "bytes differ" in err
    # and one whose collective count is off
    plan = shardplan.load_plan(plan_files["tp4"])
    plan.estimate.collectives["backward"].all_reduce += 1
    plan.save(off)
    code, out, _ = run(capsys, "simulate", "llama3-debug", "--plan", str(off))
    assert code == 1
    assert "DIFFERS" in next(ln for ln in out.splitlines() if "backward" in ln and "all_reduce" in ln)


def test_simulate_plan_file_at_other_shapes_is_refused(plan_files: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "llama3-debug", "--plan", str(plan_files["tp2"]), "--batch", "8")
    assert code == 2 and "--batch" in err
    assert_one_error(err)


COMMANDS = ("plan", "explain", "check", "diff", "simulate", "verify", "schema")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    examples = out.split("examples:\n", 1)[1]
    assert f"shardplan {command}" in examples, out


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "examples:" in out and "--mesh" in out
    code, out, _ = run(capsys, "--help")
    assert code == 0
    listed = out.split("commands:", 1)[1]
    assert all(f"    {c} " in listed for c in COMMANDS), out
    assert "examples:" in out


def test_no_command_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 2 and "usage: shardplan" in err and "Traceback" not in err


def test_unexpected_error_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import shardplan.cli as cli

    def broken(args):
        raise RuntimeError("solver exploded\nwith details")

    monkeypatch.delenv("SHARDPLAN_TRACEBACK", raising=False)
    monkeypatch.setattr(cli, "cmd_schema", broken)
    code, _, err = run(capsys, "schema")
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0] == "shardplan: error: internal error: RuntimeError: solver exploded"
    assert "SHARDPLAN_TRACEBACK=1" in lines[1]
    monkeypatch.setenv("SHARDPLAN_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="solver exploded"):
        main(["schema"])


def test_python_m_help() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "shardplan", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert command in proc.stdout


def test_callable_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cli_user_models.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))\n"
        "def not_a_model():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "plan", "cli_user_models:build", "--mesh", "tp=4", "--no-explain")
    assert code == 0, err
    assert "128x32" in out and "32x32" in out
    code, _, err = run(capsys, "plan", "cli_user_models:not_a_model")
    assert code == 2 and "nn.Module" in err
    assert_one_error(err)


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardplan.tools.sources import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # restored afterwards; resolve_model sets it
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ValueError, match=r"shardplan\[hf\]"):
        resolve_model("hf:llama")


def test_inputs_are_token_ids_when_the_head_is_registered_before_the_table() -> None:
    """litgpt's GPT registers ``lm_head`` before ``transformer.wte``: the first Linear reads the
    table's width, so the inputs are token ids, not features (the trace failed on them); and
    a ``block_size`` in the config (nanoGPT, litgpt) bounds the default sequence."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from shardplan.api import infer_example_inputs

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(64, 256, bias=False)
            self.wte = nn.Embedding(256, 64)
            self.pos = nn.Embedding(32, 64)
            self.config = SimpleNamespace(block_size=32)

        def forward(self, idx):
            return self.lm_head(self.wte(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))

    (ids,) = infer_example_inputs(HeadFirst(), batch_size=2, seq_len=16)
    assert ids.dtype == torch.long
    plan = shardplan.plan_model(HeadFirst(), {"tp": 2})
    assert plan.options.seq_len == 32 and plan.module_styles()["wte"] != "replicate"


def test_a_position_table_bounds_the_default_sequence_of_a_model_without_config() -> None:
    """A user's model with no config: minGPT's ``pos_emb`` Parameter of 64 positions, read
    by ``pos_emb[:, :T]``, failed at the default 2048 tokens (a broadcast error); the table's
    rows bound the default, as ``block_size`` does."""
    from tests.portability import natural

    plan = shardplan.plan_model(natural.learned_positions(), {"tp": 2}, explain=False)
    assert plan.options.seq_len == 64, plan.options
    import torch
    from torch import nn

    from shardplan.api import _table_positions

    tutorial = nn.Module()  # the PyTorch tutorial's time-major table, [max_len, 1, d_model]
    tutorial.register_buffer("pe", torch.zeros(5000, 1, 64))
    assert _table_positions(tutorial) == 5000


def test_python_m_ends_after_flushing_a_whole_output(tmp_path: Path) -> None:
    """``entry`` leaves with ``os._exit`` once the output is flushed and ``atexit`` ran: a
    piped JSON plan arrives whole, a file written with ``-o`` is complete, and the status
    is the command's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "plan.yaml"

    def python_m(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardplan", *args], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)

    piped = python_m("plan", "mlp", "--mesh", "tp=2", "--format", "json")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["mesh"]["axes"] == {"tp": 2}
    written = python_m("plan", "mlp", "--mesh", "tp=2", "-o", str(out))
    assert written.returncode == 0, written.stderr
    assert shardplan.load_plan(out).tp == 2
    refused = python_m("plan", "no-such-model")
    assert refused.returncode == 2 and refused.stderr.startswith("shardplan: error: unknown model")


@pytest.mark.parametrize("argv", [["diff", "{a}", "{b}"], ["check", "{missing}", "llama3-debug"], ["--help"]])
def test_commands_that_only_read_files_import_no_torch(argv: list[str], plan_files: dict[str, Path], tmp_path) -> None:
    """``diff`` and a ``check`` of a file that is not there answer in a blink: torch (1.3 s
    to import) is not imported for them."""
    args = [x.format(a=plan_files["tp2"], b=plan_files["tp4"], missing=tmp_path / "missing.yaml") for x in argv]
    code = ("import sys, contextlib, io\nfrom shardplan.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    main({args!r})\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
