"""``plan_model(model, world_size=N)`` / ``shardplan plan --world-size N``: every dp x tp split
of N devices planned from one trace, the fastest that fits chosen; and mesh axes the planner
does not model refused instead of priced as data parallel.

The chosen split is checked against the candidates' own estimates (the most samples per
second, ``dp * batch / step_time_s``, among those whose peak fits), never against a
hard-coded split: the estimate's pricing of data-parallel collectives may change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardplan
from shardplan import api
from shardplan.api import compare_meshes
from shardplan.apply.mesh import fake_process_group
from shardplan.cli import main
from shardplan.decide.cost import get_hardware
from shardplan.models import build_preset

BATCH = 2  # llama3-debug's example batch, per data-parallel replica
SEQ = 16


@pytest.fixture(scope="module")
def debug_model() -> nn.Module:
    return build_preset("llama3-debug")


def _samples_per_s(candidate, batch: int) -> float:
    return candidate.axes["dp"] * batch / candidate.plan.estimate.step_time_s


def _assert_chosen_is_fastest_fitting(comparison, *, limit: float, batch: int) -> None:
    fitting = [c for c in comparison.candidates if c.plan is not None and c.plan.estimate.peak_memory_bytes <= limit]
    assert fitting, "the test needs a split that fits"
    assert [c.fits for c in comparison.candidates] == [
        c.plan is not None and c.plan.estimate.peak_memory_bytes <= limit for c in comparison.candidates]
    best = max(_samples_per_s(c, batch) for c in fitting)
    chosen = comparison.candidates[comparison.chosen]
    assert chosen.fits and _samples_per_s(chosen, batch) == best
    assert comparison.plan.mesh.axes == chosen.axes


def test_every_split_of_the_world_size_is_a_candidate(debug_model: nn.Module) -> None:
    comparison = compare_meshes(debug_model, 8, explain=False, seq_len=SEQ)
    assert [c.axes for c in comparison.candidates] == [{"dp": 8 // tp, "tp": tp} for tp in (1, 2, 4, 8)]
    assert all(c.plan is not None and c.plan.mesh.axes == c.axes for c in comparison.candidates)


def test_chosen_split_is_the_fastest_that_fits_device_memory() -> None:
    """llama3-8b at batch 4: without tp, one layer's activations alone are
    s*b*h*(34 + 5*a*s/h) = 2048*4*4096*114 bytes = 3.8 GB (Korthikanti), 122 GB for 32
    layers, over an H100's 80 GB; larger tp splits fit. The default limit is the device."""
    model = build_preset("llama3-8b")
    comparison = compare_meshes(model, 8, batch_size=4, explain=False)
    device = get_hardware("h100-nvlink").memory_bytes
    assert comparison.memory_limit == device
    assert not comparison.candidates[0].fits  # dp=8,tp=1
    _assert_chosen_is_fastest_fitting(comparison, limit=device, batch=4)


def test_memory_budget_is_the_limit(debug_model: nn.Module) -> None:
    free = compare_meshes(debug_model, 8, explain=False, seq_len=SEQ)
    peaks = sorted(c.plan.estimate.peak_memory_bytes for c in free.candidates)
    budget = int(peaks[len(peaks) // 2])  # some splits above it, some at or below
    comparison = compare_meshes(debug_model, 8, explain=False, seq_len=SEQ, memory_budget=budget)
    assert comparison.memory_limit == budget
    _assert_chosen_is_fastest_fitting(comparison, limit=budget, batch=BATCH)
    assert comparison.plan.options.memory_budget == budget


def test_no_split_fits_is_a_planning_error(debug_model: nn.Module) -> None:
    comparison = compare_meshes(debug_model, 4, explain=False, seq_len=SEQ, memory_budget=1000)
    assert comparison.chosen is None
    with pytest.raises(shardplan.PlanningError, match="no dp x tp split of 4 devices"):
        shardplan.plan_model(debug_model, world_size=4, explain=False, seq_len=SEQ, memory_budget=1000)


def test_chosen_plan_equals_planning_that_mesh(debug_model: nn.Module) -> None:
    """One trace for every split changes nothing: each candidate, and the chosen plan with
    its explanations, is byte-identical to planning its mesh directly."""
    comparison = compare_meshes(debug_model, 8, explain=False, seq_len=SEQ)
    for c in comparison.candidates:
        assert c.plan.to_yaml() == shardplan.plan_model(debug_model, c.axes, explain=False, seq_len=SEQ).to_yaml()
    chosen = shardplan.plan_model(debug_model, world_size=8, seq_len=SEQ)
    assert chosen.decisions  # explained, like plan_model's default
    assert chosen.to_yaml() == shardplan.plan_model(debug_model, chosen.mesh.axes, seq_len=SEQ).to_yaml()


def test_the_model_is_traced_once(debug_model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = api.trace_model
    monkeypatch.setattr(api, "trace_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    shardplan.plan_model(debug_model, world_size=8, seq_len=SEQ)
    assert len(calls) == 1


def test_tp_beyond_every_weight_is_listed_without_a_plan() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).to("meta")
    comparison = compare_meshes(model, 8, explain=False, example_inputs=(torch.zeros(2, 4, device="meta"),))
    by_tp = {c.axes["tp"]: c for c in comparison.candidates}
    assert by_tp[8].plan is None and "largest dimension is 4" in by_tp[8].error
    assert all(by_tp[tp].plan is not None for tp in (1, 2, 4))
    assert comparison.candidates[comparison.chosen].axes["tp"] <= 4


def test_world_size_arguments(debug_model: nn.Module) -> None:
    with pytest.raises(ValueError, match="both a mesh and world_size"):
        shardplan.plan_model(debug_model, {"tp": 2}, world_size=2, seq_len=SEQ)
    with pytest.raises(ValueError, match="needs a mesh .* or world_size"):
        shardplan.plan_model(debug_model)
    for bad in (0, -4, True, 2.0, "8"):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            shardplan.plan_model(debug_model, world_size=bad, seq_len=SEQ)
    with pytest.raises(ValueError, match="tp_axis does not apply"):
        shardplan.plan_model(debug_model, world_size=2, tp_axis="tp", seq_len=SEQ)


def test_process_group_does_not_change_the_table(debug_model: nn.Module) -> None:
    """Under a process group the local check cannot make its fake group: refused, not a
    table of failures; without the check the table is the one planned without a group."""
    alone = compare_meshes(debug_model, 4, explain=False, seq_len=SEQ, check=False)
    with fake_process_group(4):
        with pytest.raises(shardplan.PlanningError, match="while a process group exists.*check=False"):
            compare_meshes(debug_model, 4, explain=False, seq_len=SEQ)
        grouped = compare_meshes(debug_model, 4, explain=False, seq_len=SEQ, check=False)
    assert [c.plan.to_yaml() for c in grouped.candidates] == [c.plan.to_yaml() for c in alone.candidates]
    assert grouped.chosen == alone.chosen


# --------------------------------------------------------------------------- mesh axes


@pytest.mark.parametrize(("axis", "what"), [("pp", "pipeline parallelism"), ("cp", "context parallelism")])
def test_unmodelled_axes_are_refused(debug_model: nn.Module, axis: str, what: str) -> None:
    with pytest.raises(ValueError, match=rf"mesh axis '{axis}' \(size 2\) is {what}, which the planner does not "
                                         rf"model.*e\.g\. on \{{'dp': 2, 'tp': 2\}}"):
        shardplan.plan_model(debug_model, {axis: 2, "dp": 2, "tp": 2}, explain=False, seq_len=SEQ)


@pytest.mark.parametrize("axes", [{"ep": 2}, {"dp": 2, "ep": 2}])
def test_an_expert_axis_is_not_taken_for_the_tensor_parallel_one(debug_model: nn.Module, axes) -> None:
    """``{"ep": 8}`` once planned tensor parallelism on 'ep' without a word; now it splits
    expert banks, which a dense model lacks; asked for by name, tp may still run on it."""
    from shardplan.decide.solve import PlanningError

    with pytest.raises(PlanningError, match=r"mesh has ep=2, but \w+ has no expert bank.*drop 'ep', or name those ranks 'dp'"):
        shardplan.plan_model(debug_model, axes, explain=False, seq_len=SEQ)
    named = shardplan.plan_model(debug_model, axes, tp_axis="ep", explain=False, seq_len=SEQ)
    assert named.mesh.tp_axis == "ep"


def test_unknown_axis_is_refused(debug_model: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"mesh axis 'x' \(size 2\) is neither the tensor-parallel axis 'tp' nor a "
                                         r"data axis \(dp, dp_shard, dp_replicate, fsdp\).*tp_axis='x'"):
        shardplan.plan_model(debug_model, {"x": 2, "tp": 2}, explain=False, seq_len=SEQ)
    with pytest.raises(ValueError, match=r"no tensor-parallel axis, only data axes.*\{'dp': 8, 'tp': 1\}"):
        shardplan.plan_model(debug_model, {"dp": 8}, explain=False, seq_len=SEQ)


def test_size_one_axes_and_other_tp_names_are_fine(debug_model: nn.Module) -> None:
    """An axis of size 1 does nothing; a tp axis of another name is still the last non-data axis."""
    base = shardplan.plan_model(debug_model, {"dp": 2, "tp": 2}, explain=False, seq_len=SEQ)
    padded = shardplan.plan_model(debug_model, {"pp": 1, "dp": 2, "tp": 2}, explain=False, seq_len=SEQ)
    assert padded.estimate == base.estimate and padded.rules == base.rules
    named = shardplan.plan_model(debug_model, {"dp": 2, "model": 2}, explain=False, seq_len=SEQ)
    assert named.mesh.tp_axis == "model" and named.estimate == base.estimate


def test_data_axes_split_state_as_documented(debug_model: nn.Module) -> None:
    """Under FSDP the last data axis shards parameter state and the ones before it hold
    replicas (HSDP, as fully_shard on a 2-D mesh); dp_replicate never shards, as under DDP."""
    def peak(axes, **kw):
        return shardplan.plan_model(debug_model, axes, explain=False, seq_len=SEQ, **kw).estimate.peak_memory_bytes

    sharded = peak({"dp": 4, "tp": 2})
    assert peak({"dp_shard": 4, "tp": 2}) == peak({"fsdp": 4, "tp": 2}) == sharded
    replicated = peak({"dp": 4, "tp": 2}, data_parallel="ddp")
    assert replicated > sharded
    assert peak({"dp_replicate": 4, "tp": 2}) == replicated
    assert peak({"dp_replicate": 2, "dp_shard": 2, "tp": 2}) == peak({"dp": 2, "tp": 2})
    assert peak({"dp": 2, "fsdp": 4, "tp": 2}) == sharded


# --------------------------------------------------------------------------- command line


def test_cli_prints_every_split_then_the_chosen_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-debug", "--world-size", "8", "--no-explain"]) == 0
    out, err = capsys.readouterr()
    table, _, plan_part = out.partition("\nchosen: ")
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["dp=8,tp=1", "dp=4,tp=2", "dp=2,tp=4", "dp=1,tp=8"]
    assert sum("chosen" in row for row in rows) == 1
    chosen = next(row for row in rows if "chosen" in row).split("│")[1].strip()
    assert plan_part.startswith(chosen) and f"mesh: {chosen} (tensor parallel on 'tp'" in plan_part
    assert "memory limit: 74.51 GiB per device (h100-nvlink's device memory)" in table


def test_cli_plan_file_is_the_mesh_plan(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    chosen_file, direct_file = tmp_path / "chosen.yaml", tmp_path / "direct.yaml"
    assert main(["plan", "llama3-debug", "--world-size", "4", "-o", str(chosen_file)]) == 0
    out, err = capsys.readouterr()
    mesh = shardplan.load_plan(chosen_file).mesh.axes
    assert "samples/s" in out and f"plan for {','.join(f'{k}={v}' for k, v in mesh.items())} to" in err
    assert main(["plan", "llama3-debug", "--mesh", ",".join(f"{k}={v}" for k, v in mesh.items()),
                 "-o", str(direct_file)]) == 0
    assert chosen_file.read_text() == direct_file.read_text()


def test_cli_yaml_on_stdout_keeps_the_table_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-debug", "--world-size", "4", "--no-explain", "--format", "yaml"]) == 0
    out, err = capsys.readouterr()
    assert shardplan.Plan.from_yaml(out).mesh.axes["dp"] * shardplan.Plan.from_yaml(out).tp == 4
    assert "samples/s" in err and "chosen: " in err


def test_cli_mesh_and_world_size_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-debug", "--world-size", "4", "--mesh", "tp=4"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_no_split_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-debug", "--world-size", "2", "--no-explain", "--memory-budget", "1KB"]) == 2
    out, err = capsys.readouterr()
    assert out.count("no plan (below)") == 2
    assert err.startswith("shardplan: error: no dp x tp split of 2 devices") and "Traceback" not in err


def test_cli_unmodelled_axis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-debug", "--mesh", "pp=2,tp=2", "--no-explain"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardplan: error: mesh axis 'pp' (size 2) is pipeline parallelism") and "{'tp': 2}" in err
