"""``shardplan verify`` and :func:`shardplan.tools.verify.verify`.

Input problems are refused before any process starts (cheap). The end-to-end cases each
start real gloo ranks (a few seconds of spawn + import each on 2 CPU cores), so there are
few of them: a plan that matches (llama3-debug, through the CLI), a plan edited to be wrong
(exit 1, the guilty gradient named), a rank that raises and a run that times out (exit 2,
one line), and a Mixtral-style MoE whose packed expert weights compare exactly as gathered.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import shardplan
from shardplan.cli import main
from shardplan.tools.launch import RankError, RankTimeout
from shardplan.tools.verify import TOLERANCES, VerifyError, compare, verify


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(err: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert lines[0].startswith("shardplan: error: "), err


@pytest.fixture(scope="module")
def tp2_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "tp2.yaml"
    assert main(["plan", "llama3-debug", "--mesh", "tp=2", "--no-explain", "-o", str(path)]) == 0
    return path


@pytest.fixture()
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of small models on sys.path (spawned ranks inherit sys.path)."""
    (tmp_path / "verify_user_models.py").write_text(textwrap.dedent("""
        import time
        import torch
        import torch.distributed as dist


        class Small(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up = torch.nn.Linear(16, 64)
                self.down = torch.nn.Linear(64, 16)

            def forward(self, x):
                # only on the gloo ranks: planning may run blocks under a fake process group
                gloo = dist.is_initialized() and dist.get_backend() == "gloo"
                rank = dist.get_rank() if gloo else None
                if rank == 1 and self.crash:
                    raise RuntimeError("boom on rank 1")
                if rank == 0 and self.hang:
                    time.sleep(3600)
                return self.down(torch.relu(self.up(x)))


        def crashing():
            model = Small()
            model.crash, model.hang = True, False
            return model


        def hanging():
            model = Small()
            model.crash, model.hang = False, True
            return model


        class Fused(torch.nn.Module):
            # gate and up projections in one Linear, split by chunk(2, -1)

            def __init__(self):
                super().__init__()
                self.gate_up = torch.nn.Linear(16, 128)
                self.down = torch.nn.Linear(64, 16)

            def forward(self, x):
                gate, up = self.gate_up(x).chunk(2, -1)
                return self.down(torch.nn.functional.silu(gate) * up)


        def fused():
            return Fused()


        def tiny_mixtral():
            from shardplan.interop.hf import build_hf_model

            return build_hf_model("mixtral", tiny=True, device=torch.get_default_device())[0]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "verify_user_models"


# --------------------------------------------------------------------------- compare


def test_compare_within_and_past_tolerance() -> None:
    ref = torch.tensor([1.0, -2.0, 100.0])
    ok = compare([("a", ref + torch.tensor([1e-6, 0.0, 5e-4]), ref)], atol=1e-5, rtol=1e-5)
    assert ok["passed"] and ok["where"] == "a" and ok["max_abs"] == pytest.approx(5e-4, rel=2e-2)
    assert ok["ratio"] < 1.0  # 5e-4 <= 1e-5 + 1e-5 * 100: the relative part
    bad = compare([("a", ref, ref), ("b", ref + 2e-3, ref)], atol=1e-5, rtol=1e-5)
    assert not bad["passed"] and bad["where"] == "b" and bad["ratio"] > 1.0
    assert bad["per"]["a"] == (0.0, 0.0)


def test_compare_scales_the_relative_part_by_the_tensors_largest_value() -> None:
    """A summed gradient's small elements round at the size of its large ones: 5e-4 off
    an element of 1 passes beside an element of 100 (1e-5 + 1e-5 * 100), fails alone."""
    beside = torch.tensor([1.0, 100.0])
    assert compare([("g", beside + torch.tensor([5e-4, 0.0]), beside)], atol=1e-5, rtol=1e-5)["passed"]
    alone = torch.tensor([1.0, 1.0])
    assert not compare([("g", alone + torch.tensor([5e-4, 0.0]), alone)], atol=1e-5, rtol=1e-5)["passed"]


def test_compare_exact_shape_and_nonfinite() -> None:
    ref = torch.ones(4)
    assert compare([("w", ref.clone(), ref)], 0.0, 0.0)["passed"]
    assert not compare([("w", ref + 1e-7, ref)], 0.0, 0.0)["passed"]
    shape = compare([("w", torch.ones(2, 2), ref)], 1.0, 0.0)
    assert not shape["passed"] and "shape" in shape["problems"][0]
    nan = compare([("w", torch.full((4,), float("nan")), ref)], 1.0, 0.0)
    assert not nan["passed"] and "non-finite" in nan["problems"][0]


def test_tolerances_are_test_numerics_float32_numbers() -> None:
    """test_numerics' numbers, the gradient's widened to 5e-6 + 5e-6 max|grad| where another
    BLAS kernel gave CLIP's text position-embedding gradient 3.9e-6 at max|grad| 0.70."""
    assert TOLERANCES["output"][0] == 1e-5 and TOLERANCES["loss"][0] == 1e-5 and TOLERANCES["grad"] == (5e-6, 5e-6)
    assert TOLERANCES["weights"] == (0.0, 0.0)


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_colwise_keeps_the_modules_order(user_models: str, rank: int) -> None:
    """A packed Linear keeps [gate_r; up_r] on rank r, and its placement says so: the
    DTensor's global view is the module's own [gate; up], so verify (and checkpoints)
    compare the gathered weight with the module's as it is. On the fake group each rank's
    slice is cut locally (``src_data_rank=None``), checked against slicing by hand."""
    from torch.distributed.tensor import distribute_tensor

    from shardplan.apply.mesh import fake_process_group, make_mesh
    from shardplan.apply.state import _strided_blocks
    from shardplan.apply.styles import packed_placement
    from shardplan.tools.sources import resolve_model

    model, _, _ = resolve_model(f"{user_models}:fused", device="cpu")
    plan = shardplan.plan_model(resolve_model(f"{user_models}:fused")[0], {"tp": 2}, explain=False, seq_len=16)
    assert plan.rule_for("gate_up").style == "packed_colwise"
    with fake_process_group(2, rank=rank):
        mesh = make_mesh({"tp": 2})
        for _, p in model.gate_up.named_parameters():
            d = distribute_tensor(p.detach(), mesh, [packed_placement(parts=2, dim=0)], src_data_rank=None)
            gate, up = p.detach().chunk(2, 0)
            assert torch.equal(d.to_local(), torch.cat([gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]]))
            half, quarter = p.shape[0] // 2, p.shape[0] // 4  # DCP sees two chunks per rank, one in each part
            rest, zeros = tuple(p.shape[1:]), (0,) * (p.dim() - 1)  # (global offsets, sizes, local offsets)
            assert _strided_blocks(d) == [((rank * quarter, *zeros), (quarter, *rest), (0, *zeros)),
                                          ((half + rank * quarter, *zeros), (quarter, *rest), (quarter, *zeros))]


# --------------------------------------------------------------------------- refused before launch


def test_nproc_must_equal_plan_tp(tp2_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="tp=2 but nproc=4"):
        verify("llama3-debug", plan=shardplan.load_plan(tp2_plan), nproc=4)
    code, _, err = run(capsys, "verify", "llama3-debug", "--plan", str(tp2_plan), "--nproc", "4")
    assert code == 2 and "nproc" in err
    assert_one_error(err)
    code, _, err = run(capsys, "verify", "llama3-debug", "--mesh", "tp=4", "--nproc", "2")
    assert code == 2 and "tp=4" in err
    assert_one_error(err)


def test_plan_for_another_model_is_refused(tp2_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "gpt2-debug", "--plan", str(tp2_plan))
    assert code == 2 and "fingerprint" in err.lower() or "sha256" in err
    assert_one_error(err)


def test_planning_options_with_a_plan_are_refused(tp2_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "llama3-debug", "--plan", str(tp2_plan), "--mesh", "tp=2")
    assert code == 2 and "--mesh" in err
    assert_one_error(err)
    with pytest.raises(ValueError, match="sequence_parallel"):
        verify("llama3-debug", plan=shardplan.load_plan(tp2_plan), sequence_parallel=True)


def test_big_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "llama3-8b", "--nproc", "8")
    assert code == 2 and "8.03B parameters" in err
    assert_one_error(err)


def test_bad_timeout_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "llama3-debug", "--timeout", "0")
    assert code == 2 and "--timeout" in err


def test_rank_failures_become_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """RankError / RankTimeout -> VerifyError -> exit 2 in one line (--traceback adds it)."""
    import shardplan.tools.launch as launch

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad shard\n"

    def rank_error(*args, **kwargs):
        raise RankError("rank 1 of 2 failed", rank=1, traceback_text=tb, failures={1: tb})

    def rank_timeout(*args, **kwargs):
        raise RankTimeout("timed out", ranks=(0, 1), timeout_s=kwargs["timeout_s"])

    monkeypatch.setattr(launch, "run_on_gloo", rank_error)
    with pytest.raises(VerifyError, match="rank 1 of 2 failed: ValueError: bad shard") as info:
        verify("llama3-debug")
    assert info.value.rank == 1 and "x.py" in info.value.details
    code, _, err = run(capsys, "verify", "llama3-debug")
    assert code == 2 and "ValueError: bad shard" in err and "--traceback" in err
    assert_one_error(err)
    code, _, err = run(capsys, "verify", "llama3-debug", "--traceback")
    assert code == 2 and 'File "x.py"' in err and err.strip().splitlines()[-1].startswith("shardplan: error:")

    monkeypatch.setattr(launch, "run_on_gloo", rank_timeout)
    code, _, err = run(capsys, "verify", "llama3-debug", "--timeout", "7")
    assert code == 2 and "timed out after 7s" in err and "[0, 1]" in err
    assert_one_error(err)


# --------------------------------------------------------------------------- real gloo ranks


def test_verify_llama3_debug_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", "llama3-debug", "--nproc", "2")
    assert code == 0, out + err
    for quantity in ("weights (21)", "output", "loss", "grad (21)"):
        row = next(ln for ln in out.splitlines() if quantity in ln)
        assert "pass" in row and "FAIL" not in row, out
    assert "largest gradient differences:" in out and "worst parameter:" in out
    assert "PASS: llama3-debug" in out
    assert "Traceback" not in err and "[shardplan.tools.launch" not in err


def test_verify_finds_a_wrong_plan(tp2_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The final norm declared sequence-parallel on a replicated input: the forward is the
    same on every rank, but its weight gradient is summed over both ranks' (identical)
    tokens: doubled. Only a gradient check catches it."""
    plan = shardplan.load_plan(tp2_plan)
    norm = next(r for r in plan.rules if r.module == "norm")
    assert norm.style == "replicate"
    norm.style, norm.input_layouts = "sequence_parallel", "Shard(1)"
    wrong = tmp_path / "wrong.yaml"
    plan.save(wrong)
    code, out, err = run(capsys, "verify", "llama3-debug", "--plan", str(wrong), "--nproc", "2")
    assert code == 1, out + err
    grad = next(ln for ln in out.splitlines() if ln.lstrip("│ ").startswith("grad"))
    assert "FAIL" in grad and "norm.weight" in grad
    output = next(ln for ln in out.splitlines() if ln.lstrip("│ ").startswith("output"))
    assert "pass" in output
    assert "worst parameter: norm.weight" in out and "FAIL: llama3-debug" in out
    assert "differs" in err and "Traceback" not in err


def test_rank_that_raises_is_exit_2(user_models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", f"{user_models}:crashing", "--nproc", "2", "--timeout", "120")
    assert code == 2, out + err
    assert "rank 1 of 2 failed: RuntimeError: boom on rank 1" in err
    assert_one_error(err)


def test_rank_that_hangs_times_out(user_models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", f"{user_models}:hanging", "--nproc", "2", "--timeout", "4")
    assert code == 2, out + err
    assert "timed out after 4s" in err
    assert_one_error(err)


def test_moe_packed_experts(user_models: str) -> None:
    """moe_tp_experts packs gate/up per rank; the gathered weights equal the module's exactly."""
    pytest.importorskip("transformers")
    result = verify(f"{user_models}:tiny_mixtral", nproc=2, timeout_s=240, _pinned={"model.layers.*.mlp.experts": "moe_tp_experts"})
    styles = set(result.plan.module_styles().values())
    assert "moe_tp_experts" in styles, styles
    assert result.passed, "\n".join(f"{r}" for r in result.rows) + "\n" + "\n".join(result.problems)
    assert result.row("weights").max_abs == 0.0
    assert result.sharded_params > 0 and result.worst_param


def test_sequence_parallel_around_a_block_that_runs_whole_matches_one_process() -> None:
    """6 heads at tp=4: attention runs whole, its output projection slices its input and
    reduce-scatters back onto sequence shards (rowwise_split_input -> Shard(1))."""
    result = verify("tests.portability.root_param:six_heads", nproc=4, seq_len=16, sequence_parallel=True, timeout_s=240)
    rule = result.plan.rule_for("layers.0.attention.wo")
    assert (rule.style, rule.output_layouts) == ("rowwise_split_input", "Shard(1)")
    assert result.passed, "\n".join(f"{r}" for r in result.rows) + "\n" + "\n".join(result.problems)


def test_dropout_runs_as_the_identity_in_both_models() -> None:
    """A rank draws its dropout mask over its shard, one process over the whole tensor: the
    masks never agree, so verify failed on any model left in training mode with dropout
    (a BERT-style classifier at p=0.1). Both runs now take dropout as the identity: modules,
    ``F.dropout`` and ``scaled_dot_product_attention``'s ``dropout_p``."""
    import torch.nn.functional as F

    from shardplan.tools.verify import NoDropout

    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop, self.proj = nn.Dropout(0.5), nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(self.drop(x)).view(2, 4, 2, 4).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0)
            return F.dropout(y, p=0.5, training=self.training)

    torch.manual_seed(0)
    model, x = Dropping().train(), torch.randn(2, 4, 8)
    with NoDropout():
        dropped = model(x)
    assert torch.equal(dropped, model.eval()(x))
    assert not torch.equal(model.train()(x), dropped)  # outside the mode, dropout still drops
