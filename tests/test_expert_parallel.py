"""Expert parallelism on gloo ranks (``shardplan.apply.experts_ep``): whole experts per rank over
an ``ep`` axis, tokens dispatched by all-to-all, against one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import tests._ep_workers as w
from tests._checks import flat_state
from shardplan.apply.experts_ep import ExpertParallel
from shardplan.apply.mesh import fake_process_group
from shardplan.tools.launch import run_on_gloo

TYPES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_on_gloo(w.every_model, world_size=2, args=(TYPES,), timeout_s=300)


@pytest.mark.parametrize("model_type", TYPES)
def test_hf_banks_split_by_whole_experts_match_one_process(runs: list[dict], model_type: str) -> None:
    """Each rank its own rows of the batch and half of every bank's experts: logits and every
    gradient (dense ones averaged over ep, as data parallel does) equal one process's."""
    for rank, result in enumerate(runs):
        got = result[model_type]
        assert got["banks"], f"{model_type}: no expert bank found"
        assert got["local_experts"][0] * 2 == w.expert_count(model_type), got["local_experts"]
        assert got["logits"] < 1e-5, (rank, got["logits"])
        worst = max(got["grads"], key=got["grads"].get)
        assert got["grads"][worst] < 1e-5, (rank, worst, got["grads"][worst])


def test_each_moe_layer_exchanges_counts_once_and_rows_four_times(runs: list[dict]) -> None:
    """Per MoE layer and training step: the counts (one host sync), the rows there and back
    forward, and the same two backward."""
    for result in runs:
        for model_type in TYPES:
            layers = len(result[model_type]["banks"])
            assert result[model_type]["counts"] == {"c10d.alltoall_base_": layers,
                                                    "c10d_functional.all_to_all_single": 4 * layers}, model_type


def test_two_adamw_steps_match_one_process(runs: list[dict]) -> None:
    for result in runs:
        weights = result["mixtral"]["weights"]
        worst = max(weights, key=weights.get)
        assert weights[worst] < 2e-4, (worst, weights[worst])


def test_a_rank_that_receives_no_tokens_still_takes_part() -> None:
    """Every pair routed to rank 0's experts: rank 1 runs a zero row through its experts so
    that its backward joins the return all-to-all (without it, rank 0 waits forever)."""
    for result in run_on_gloo(w.bank_routed_to_one_rank, world_size=2, timeout_s=120):
        assert result["out"] < 1e-6 and max(result["grads"].values()) < 1e-6, result
        assert result["num_experts"] == 4, "num_experts is the local count during the call only"


def test_a_rank_that_receives_no_sorted_rows_still_takes_part() -> None:
    """The same under torchtitan's convention: every row for rank 0's experts."""
    for result in run_on_gloo(w.sorted_rows_to_one_rank, world_size=2, timeout_s=120):
        assert result["out"] < 1e-6 and max(result["grads"].values()) < 1e-6, result


def test_an_ep_that_does_not_divide_the_experts_is_refused() -> None:
    with fake_process_group(3):
        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
        with pytest.raises(ValueError, match="4 experts, which ep=3 does not divide"):
            parallelize_module(w.TinyBank(), mesh, ExpertParallel())


def test_llama4s_bank_of_every_token_splits_over_ep_and_matches_one_process() -> None:
    """Llama 4's bank takes every token once per expert, pre-scaled by its score
    (``experts(hidden [E T, H])``, expert-major, the router's T rows): each expert's run of
    rows goes to its rank, whole, and comes back in order; no top-k is read. The plan prices
    E rows per token; FSDP over ep for the rest; 2 AdamW steps equal one process."""
    plan = _plan("llama4_text", {"ep": 2})
    assert plan.module_styles()["model.layers.0.feed_forward.experts"] == "ep_experts"
    rule = next(r for r in plan.rules if r.style == "ep_experts")
    assert rule.num_experts == 4 and "sends and receives about 8192 elements" in rule.why  # T 32 x E 4 x H 64
    results = run_on_gloo(w.planned_families, world_size=2, args=([("llama4_text", plan.to_yaml())], True, ("ep",)),
                          timeout_s=300)
    inside = _plan("llama4_text", {"ep": 2, "tp": 2})
    assert inside.rule_for("model.layers.0.feed_forward.experts").inner == "moe_tp_experts"
    results += run_on_gloo(w.planned_families, world_size=4, timeout_s=300,
                           args=([("llama4_text", inside.to_yaml())], True, ("ep", "tp")))
    for result in results:
        got = result["llama4_text"]
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, got["grads"]
        assert max(got["weights"].values()) < 5e-4
        assert got["placements"]["model.layers.0.feed_forward.experts.down_proj"].startswith("(Shard(dim=0)")


class _SummedBank(torch.nn.Module):
    """A bank of 4 experts that runs every one on every token and sums them: no routing."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 8, 12) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(4, 6, 8) * 0.1)

    def forward(self, hidden):
        gate, up = torch.einsum("th,ehi->eti", hidden, self.gate_up_proj).chunk(2, dim=-1)
        return torch.einsum("eti,eih->th", torch.nn.functional.silu(gate) * up, self.down_proj)


def test_a_bank_called_without_its_routing_is_refused_on_ep() -> None:
    import shardplan

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Flatten(0, 1), _SummedBank())
    with pytest.raises(shardplan.PlanningError, match=r"no expert bank of Sequential is called with its routing "
                                                      r"\(2: called with tensors of shapes \[\(8, 8\)\]\)"):
        shardplan.plan_model(model, {"ep": 2}, example_inputs=(torch.zeros(2, 4, dtype=torch.long),), explain=False)


# --- planned: plan_model on a mesh with an ep axis, apply_plan, fully_shard_plan -------------

def _plan(model_type: str, mesh: dict, **options):
    import shardplan
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model(model_type, tiny=True)
    return shardplan.plan_model(model, mesh, example_inputs=inputs, explain=False, **options)


@pytest.fixture(scope="module")
def planned() -> dict:
    cases = [(t, _plan(t, {"ep": 2}).to_yaml()) for t in TYPES]
    inside = [(t, _plan(t, {"ep": 2, "tp": 2}, sequence_parallel=sp).to_yaml())
              for t, sp in (("mixtral", True), ("gpt_oss", None), ("qwen3_moe", None), ("deepseek_v3", True))]
    return {"ep": run_on_gloo(w.planned_families, world_size=2, args=(cases, True, ("ep",)), timeout_s=400),
            "dp_ep": run_on_gloo(w.planned_families, world_size=4, timeout_s=400,
                                 args=([("mixtral", _plan("mixtral", {"dp": 2, "ep": 2}).to_yaml())], True, ("dp", "ep"))),
            "ep_tp": run_on_gloo(w.planned_families, world_size=4, args=(inside, True, ("ep", "tp")), timeout_s=400)}


@pytest.mark.parametrize("model_type", TYPES)
def test_a_plan_on_ep_splits_every_bank_by_whole_experts_and_nothing_else(model_type: str) -> None:
    plan = _plan(model_type, {"ep": 2})
    assert (plan.mesh.axes, plan.mesh.tp_axis, plan.mesh.ep_axis) == ({"ep": 2, "tp": 1}, "tp", "ep")
    banks = [r for r in plan.rules if r.style == "ep_experts"]
    assert banks and all(r.num_experts == w.expert_count(model_type) for r in banks), plan.rules
    assert {r.style for r in plan.rules} == {"ep_experts", "replicate"}, "ep is a data axis for every other module"
    layers = sum(plan.model.repeats.get(r.module.split(".*")[0], 1) if ".*" in r.module else 1 for r in banks)
    assert plan.estimate.collectives["forward"].all_to_all == 3 * layers  # counts, rows there, rows back
    assert plan.estimate.collectives["backward"].all_to_all == 2 * layers


@pytest.mark.parametrize("model_type", TYPES)
def test_planned_ep_with_fsdp_matches_one_process(planned: dict, model_type: str) -> None:
    """``apply_plan`` then ``fully_shard_plan`` at ep=2: dense modules FSDP over ep (each rank
    its own rows), banks out of FSDP (no data axis outside ep); logits, every gradient, and the
    weights after 2 AdamW steps equal one process on the whole batch."""
    for result in planned["ep"]:
        got = result[model_type]
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, (got["logits"], got["grads"])
        assert max(got["weights"].values()) < 5e-4, sorted(got["weights"].items(), key=lambda kv: -kv[1])[:3]
        banks = {n: p for n, p in got["placements"].items() if ".experts." in n}
        assert banks and set(banks.values()) == {"(Shard(dim=0),)"}, banks


def test_planned_dp_and_ep_shard_experts_over_dp_and_the_rest_over_both(planned: dict) -> None:
    """{dp: 2, ep: 2} on 4 ranks: the banks Shard(0) over ep and FSDP over dp; dense modules
    HSDP (replicated over dp, sharded over ep); all equal to one process on the whole batch."""
    for result in planned["dp_ep"]:
        got = result["mixtral"]
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, got["grads"]
        assert max(got["weights"].values()) < 5e-4
        assert got["placements"]["model.layers.0.mlp.experts.down_proj"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert got["placements"]["model.layers.0.self_attn.q_proj.weight"] == "(Replicate(), Shard(dim=0))"


@pytest.mark.parametrize("model_type", TYPES)
def test_planned_ep_with_tp_inside_matches_one_process(planned: dict, model_type: str) -> None:
    """{ep: 2, tp: 2} on 4 ranks: attention split by heads over tp, each ep rank's experts split
    inside over tp as moe_tp_experts splits them (gpt-oss: interleaved gate/up, biases; Mixtral
    and DeepSeek-V3 under sequence parallel, the routed and shared experts' partial sums
    reduce-scattered once where the MoE block returns), FSDP over ep for the rest; equal to
    one process."""
    for result in planned["ep_tp"]:
        got = result[model_type]
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, got["grads"]
        assert max(got["weights"].values()) < 5e-4
        down = next(v for k, v in got["placements"].items() if k.endswith(".mlp.experts.down_proj"))
        assert down.startswith("(Shard(dim=0), Shard(dim="), down  # whole experts over ep, split inside over tp


@pytest.mark.parametrize("model_type, mesh, message", [
    ("llama", {"ep": 2}, "has no expert bank"),
    ("mixtral", {"ep": 3}, "which ep=3 does not divide"),
])
def test_meshes_with_ep_the_planner_cannot_honour_are_refused(model_type: str, mesh: dict, message: str) -> None:
    from shardplan.decide.solve import PlanningError

    with pytest.raises(PlanningError, match=message):
        _plan(model_type, mesh)


def test_ep_plans_round_trip_and_bad_files_are_refused() -> None:
    import shardplan
    from shardplan.plan.model import PlanFileError

    plan = _plan("qwen3_moe", {"dp": 2, "ep": 2})
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert again == plan and again.mesh.ep_axis == "ep" and again.ep == 2
    text = plan.to_yaml()
    with pytest.raises(PlanFileError, match="needs mesh.ep_axis"):
        shardplan.Plan.from_yaml(text.replace("  ep_axis: ep\n", ""))
    with pytest.raises(PlanFileError, match="does not divide"):
        shardplan.Plan.from_yaml(text.replace("num_experts: 4", "num_experts: 3"))


def test_the_cli_plans_an_ep_mesh_and_refuses_a_bad_one(tmp_path) -> None:
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "shardplan", "plan", "hf-tiny:mixtral", "--mesh", "ep=2"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "ep_experts" in ok.stdout and "per device (tp=1, ep=2)" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "shardplan", "plan", "hf-tiny:mixtral", "--mesh", "ep=3"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) <= 2 and "ep=3" in bad.stderr, bad.stderr


@pytest.mark.parametrize("mesh, fsdp, sp", [({"ep": 64}, False, None), ({"ep": 64}, True, None),
                                            ({"dp": 2, "ep": 32}, False, None), ({"dp": 2, "ep": 32}, True, None),
                                            ({"ep": 8, "tp": 2}, True, True), ({"dp": 2, "ep": 8, "tp": 4}, True, None),
                                            ({"dp": 2, "ep": 8, "tp": 4}, True, True)])
def test_simulated_collectives_at_64_ranks_equal_the_prediction(mesh: dict, fsdp: bool, sp: bool | None) -> None:
    """On the fake group (its all-to-all hands each rank back what it sent, so every count and
    shape stays consistent), 64 experts over 64, 32 or 8 ranks (with tp inside, and sequence
    parallel): the count exchange and the four row exchanges per MoE layer, the tp
    collectives, and under FSDP the dense units over dp x ep and the banks over dp, as the
    estimate predicts them."""
    import shardplan
    from shardplan.interop.hf import build_hf_model
    from shardplan.interop.hf_models import hf_config, shrink_config, transformers_module
    from shardplan.tools.simulate import simulate

    cfg = hf_config(transformers_module(), "mixtral", None)
    shrink_config(cfg)
    cfg.num_local_experts = 64
    model, inputs, _ = build_hf_model("mixtral", device="cpu", config=cfg, batch_size=8)
    plan = shardplan.plan_model(model, mesh, example_inputs=inputs, explain=False, sequence_parallel=sp)
    result = simulate(model.float(), plan, inputs, fsdp=fsdp)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["forward"]["all_to_all"] == 3 * cfg.num_hidden_layers


def _exact(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:3]} differ"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("saved_on", [{"ep": 2}, {"ep": 2, "tp": 2}])
def test_checkpoints_saved_at_ep_2_load_exactly_at_ep_4_and_unsharded(tmp_path, saved_on: dict) -> None:
    """DCP of a model and its AdamW state saved at ep=2 (each rank half of every bank), or at
    ep=2 x tp=2 (each rank's experts split inside, the packed [gate; up] on tp a
    ``_StridedShard``), loads at ep=4 and into the plain model in one process, every tensor
    equal; so do ``load_full_state_dict`` and ``load_checkpoint`` of the gathered model at ep=4."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    from shardplan.interop.hf import build_hf_model

    folder, file = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    ranks = saved_on["ep"] * saved_on.get("tp", 1)
    first = run_on_gloo(w.save_at_ep, world_size=ranks, args=(_plan("mixtral", saved_on).to_yaml(), folder), timeout_s=240)
    saved, saved_optim = first[0]["model"], first[0]["optim"]
    plain, _, _ = build_hf_model("mixtral", tiny=True, device="cpu", seed=5)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    plain.load_state_dict(state["model"])
    _exact(plain.state_dict(), saved, "unsharded DCP load of the ep=2 checkpoint")
    safetensors.torch.save_file({k: v.contiguous() for k, v in saved.items()}, file)
    loaded = run_on_gloo(w.load_at_ep, world_size=4, timeout_s=240,
                         args=(_plan("mixtral", {"ep": 4}).to_yaml(), folder, saved, file))
    _exact(flat_state(loaded[0]["dcp_optim"]), flat_state(saved_optim), "AdamW state loaded at ep=4 (gathered on rank 0)")
    for result in loaded:
        _exact(result["dcp"], saved, "DCP load at ep=4")
        _exact(result["from_full"], saved, "load_full_state_dict at ep=4")
        _exact(result["from_file"], saved, "load_checkpoint at ep=4")
        assert result["local"]["model.layers.0.mlp.experts.gate_up_proj"][0] == 1, result["local"]


def test_world_size_compares_ep_meshes_for_moe_models_only() -> None:
    """``--world-size`` lists, beside every dp x tp split, the same tp with the largest ep that
    divides the experts and the data ranks; samples per step count every data rank (dp x ep)."""
    from shardplan.api import compare_meshes
    from shardplan.decide.splits import data_ranks
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model("mixtral", tiny=True)
    table = compare_meshes(model, 8, example_inputs=inputs, explain=False)
    ep = [c for c in table.candidates if "ep" in c.axes]
    assert [c.axes for c in ep] == [{"dp": 2, "ep": 4, "tp": 1}, {"dp": 1, "ep": 4, "tp": 2}, {"dp": 1, "ep": 2, "tp": 4}]
    assert all(c.plan is not None and c.plan.mesh.ep_axis == "ep" for c in ep), [c.error for c in ep]
    one = ep[0]
    assert one.samples_per_s == data_ranks(one.axes) * one.plan.options.batch_size / one.plan.estimate.step_time_s == (
        8 * one.plan.options.batch_size / one.plan.estimate.step_time_s)
    dense, dense_inputs, _ = build_hf_model("llama", tiny=True)
    assert not [c for c in compare_meshes(dense, 8, example_inputs=dense_inputs, explain=False).candidates
                if "ep" in c.axes]


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_an_ep_plan_exports_to_hugging_face_and_loads_there(tmp_path, model_type: str) -> None:
    """``Plan.to_hf_ep_plan`` gives transformers' own ``base_model_ep_plan`` for these models and
    the ``DistributedConfig`` sizes of the same layout; ``from_pretrained`` with them on 2 gloo
    ranks gives one process's logits and puts on each rank the experts shardplan puts there."""
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model(model_type, tiny=True, device="cpu", seed=0)
    plan = shardplan_plan(model, {"ep": 2}, inputs)
    ep_plan, config = plan.to_hf_ep_plan(model)
    assert ep_plan == model.ep_plan and config == {"ep_size": 2, "fsdp_size": 2}
    model.save_pretrained(tmp_path)
    for result in run_on_gloo(w.hf_loads_exported_ep_plan, world_size=2, args=(str(tmp_path), ep_plan, config),
                              timeout_s=240):
        assert result["logits"] < 1e-5, result["logits"]
        assert result["own_experts"] and all(result["own_experts"].values()), result["own_experts"]


def test_ep_plans_hugging_face_cannot_load_are_refused() -> None:
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model("mixtral", tiny=True)
    with pytest.raises(ValueError, match="tp=2|tp axis|slices each tp group"):
        shardplan_plan(model, {"ep": 2, "tp": 2}, inputs).to_hf_ep_plan(model)
    with pytest.raises(ValueError, match="to_hf_tp_plan"):
        shardplan_plan(model, {"tp": 2}, inputs).to_hf_ep_plan(model)
    with pytest.raises(ValueError, match="ep_experts.*no Hugging Face tp_plan counterpart"):
        shardplan_plan(model, {"ep": 2}, inputs).to_hf_tp_plan(model)


def shardplan_plan(model, mesh: dict, inputs):
    import shardplan

    return shardplan.plan_model(model, mesh, example_inputs=inputs, explain=False)


MORE_TYPES = ["qwen2_moe", "olmoe", "granitemoe", "jamba", "minimax", "qwen3_next"]


def test_more_families_with_routed_banks_match_one_process_at_ep_2() -> None:
    """Routed banks in other code: Qwen2-MoE (a gated shared expert), OLMoE, Granite-MoE (its
    own bank layout), Jamba and Qwen3-Next (Mamba / linear-attention layers between), MiniMax;
    planned on {ep: 2}, FSDP over ep, each rank its rows: equal to one process.
    ``benchmarks/ep_sweep.py`` runs every type with a ``base_model_ep_plan``."""
    cases = [(t, _plan(t, {"ep": 2}).to_yaml()) for t in MORE_TYPES]
    for result in run_on_gloo(w.planned_families_safe, world_size=2, args=(cases, True, ("ep",)), timeout_s=400):
        for t in MORE_TYPES:
            got = result[t]
            assert "error" not in got, (t, got.get("error"))
            assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, (t, got["logits"], got["grads"])


def test_verify_runs_expert_parallel_plans() -> None:
    """``shardplan verify --mesh ep=2``: each ep rank its own rows, the ranks' mean loss and
    the averaged dense gradients against one process on the whole batch."""
    from shardplan.tools.verify import verify

    result = verify("hf-tiny:qwen3_moe", nproc=2, mesh={"ep": 2}, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert "ep=2 plan on 2 gloo ranks" in result.summary()
    result = verify("hf-tiny:deepseek_v3", nproc=4, mesh={"ep": 2, "tp": 2}, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    with pytest.raises(ValueError, match="use nproc=2"):
        verify("hf-tiny:qwen3_moe", nproc=4, mesh={"ep": 2})
    with pytest.raises(ValueError, match="batch 3 does not split over ep=2"):
        verify("hf-tiny:qwen3_moe", nproc=2, mesh={"ep": 2}, batch_size=3)


def test_a_bank_not_called_with_its_routing_beside_routed_ones_stays_dense() -> None:
    """Inkling's shared experts are a 3-D bank called on the tokens, not with the router's
    choice: they stay as the tensor-parallel plan has them (a data-parallel module on ep, in
    the dense FSDP units), with a warning, while the routed bank goes over ep; the collectives
    FSDP and the dispatch issue at dp=2 x ep=2 are the predicted ones."""
    import shardplan
    from shardplan.interop.hf import build_hf_model
    from shardplan.tools.simulate import simulate

    model, inputs, _ = build_hf_model("inkling_text", tiny=True, device="cpu")
    plan = shardplan.plan_model(model, {"dp": 2, "ep": 2}, example_inputs=inputs, explain=False)
    styles = plan.module_styles()
    assert styles["model.layers.0.mlp.experts"] == "ep_experts" and styles["model.layers.0.mlp.shared_experts"] == "replicate"
    assert any("shared_experts: kept as the tensor-parallel plan has it" in w for w in plan.warnings), plan.warnings
    result = simulate(model.float(), plan, inputs, fsdp=True)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


# torchtitan's calling convention: the MoE layer routes, sorts the rows by expert, and calls
# experts(num_tokens_per_expert [E], rows [N, H]) (tests/portability/titan_moe.py)
TITAN = "tests.portability.titan_moe:titan_moe"


def _titan_plan(mesh: dict, **options):
    import shardplan
    from tests.portability.titan_moe import titan_moe

    with torch.device("meta"):
        model = titan_moe()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, mesh, example_inputs=(tokens,), explain=False, **options)


@pytest.mark.parametrize("mesh", [{"ep": 2}, {"ep": 2, "tp": 2}, {"tp": 2}])
def test_a_bank_called_on_rows_sorted_by_expert_plans_on_ep_with_attention_split(mesh: dict) -> None:
    """The bank splits by whole experts over ep; on tp, attention splits by heads with the
    block's head count made local: the check, which cannot run the bank on meta (it splits its
    rows by ``counts.tolist()``), runs the block around it (before, the whole block went
    unchecked, and ``view(b, s, self.heads, -1)`` cut each rank's 2 heads into 4 narrow ones:
    a wrong result with no error)."""
    plan = _titan_plan(mesh)
    styles = plan.module_styles()
    assert styles["layers.0.moe.experts"] in (("ep_experts",) if "ep" in mesh else ("moe_tp_experts", "moe_whole_experts")), styles
    assert not [w for w in plan.warnings if "check skipped" in w], plan.warnings
    if "tp" in mesh:
        assert [styles[f"layers.0.{w}"] for w in ("wq", "wk", "wv", "wo")] == ["colwise"] * 3 + ["rowwise"], plan.warnings
        assert [(a.module, a.values) for a in plan.attributes] == [("layers.*", {"heads": 2})], plan.attributes


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"ep": 2, "tp": 2}])
def test_built_on_the_cpu_the_block_around_the_bank_is_checked_as_on_meta(mesh: dict) -> None:
    """Built on the CPU (real weights, real tokens), the bank's trace assumed its output shape
    (it splits its rows by ``counts.tolist()``); the check ran the block's children one by
    one, not the block's own code, so ``view(b, s, self.heads, -1)`` with 4 heads on 2 heads'
    width ran unchecked (4 narrow heads on each rank: a wrong result, no error). The bank is
    stood in for now, shaped as its rows (not as its first argument, the counts), and the
    block gets its local head count as on meta."""
    import shardplan
    from tests.portability.titan_moe import titan_moe

    plan = shardplan.plan_model(titan_moe(), mesh, example_inputs=(torch.zeros(2, 16, dtype=torch.long),), explain=False)
    assert [a.values for a in plan.attributes] == [a.values for a in _titan_plan(mesh).attributes] == [{"heads": 2}]
    assert not [w for w in plan.warnings if "not checked" in w or "check skipped" in w], plan.warnings


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"ep": 2, "tp": 2}])
def test_a_bank_whose_shapes_read_both_ways_is_not_split_inside_on_the_wrong_dim(mesh: dict) -> None:
    """w1, w3 [E, H, I] and w2 [E, I, H] read as [E, X, H] + [E, H, I] too, with H and I
    swapped: split inside over tp, the ranks crashed (mat1 and mat2 shapes cannot be
    multiplied). The layout must give the width the bank returns, or the bank is split by
    whole experts only (over ep, or over tp), which runs; counted collectives equal the
    prediction."""
    import shardplan
    from shardplan.tools.simulate import simulate
    from tests.portability.titan_moe import titan_bmm_moe

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = shardplan.plan_model(titan_bmm_moe(), mesh, example_inputs=(tokens,), explain=False)
    rule = next(r for r in plan.rules if r.module == "layers.*.moe.experts")
    assert rule.style != "moe_tp_experts" and rule.inner is None, rule
    result = simulate(titan_bmm_moe(), plan, (tokens,))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize(("mesh", "nproc"), [({"tp": 2}, 2), ({"ep": 2}, 2), ({"ep": 2, "tp": 2}, 4)])
def test_a_bank_called_on_rows_sorted_by_expert_matches_one_process(mesh: dict, nproc: int) -> None:
    """Outputs, loss and every gradient against one process on the whole batch: the counts
    exchanged, each run of rows sent to its expert's rank, regrouped by expert there, and
    sent back in the order they came."""
    from shardplan.tools.verify import verify

    result = verify(TITAN, nproc=nproc, mesh=mesh, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("mesh", [{"ep": 4}, {"ep": 2, "tp": 2}])
def test_a_bank_called_on_rows_sorted_by_expert_collectives_equal_the_prediction(mesh: dict) -> None:
    from shardplan.tools.simulate import simulate
    from tests.portability.titan_moe import titan_moe

    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    model = titan_moe()
    plan = _titan_plan(mesh)
    result = simulate(model, plan, (tokens,))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["forward"]["all_to_all"] == 3 * len(model.layers)


def test_torchtitans_own_deepseek_v3_splits_its_experts_over_ep_and_matches_one_process() -> None:
    """torchtitan 0.3's DeepSeek-V3 (MLA, a dense first layer, shared experts; its bank called
    as ``inner_experts(rows, num_tokens_per_expert)``, rows first), shrunk: planned on ep=2
    (the bank of ``layers.{1}``, a folded rule's index set, is split: parallelize_module once
    skipped it with a warning), and 2 gloo ranks match one process; on ep=2 x tp=2 with FSDP
    the fake group counts the predicted collectives."""
    import warnings

    from benchmarks import ecosystem as eco
    from shardplan.tools.simulate import simulate
    from shardplan.tools.verify import verify

    why = eco.library_missing("torchtitan")
    if why:
        pytest.skip(why)
    result = verify("benchmarks.ecosystem:build_titan_deepseek_v3", nproc=2, mesh={"ep": 2}, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert result.plan.module_styles()["layers.1.moe.routed_experts.inner_experts"] == "ep_experts"
    model, tokens = eco.build_titan_deepseek_v3(), torch.randint(0, 64, (2, 16))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not be resolved.*")  # a key parallelize_module skips
        plan = shardplan_plan(model, {"ep": 2, "tp": 2}, (tokens,))
        counted = simulate(model, plan, (tokens,), fsdp=True)
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_hugging_faces_ep_plan_imports_as_a_priced_plan_and_exports_back(model_type: str) -> None:
    """``from_hf_ep_plan`` reads the model's ``base_model_ep_plan``: the banks it names go whole
    over ep, every other weight stays whole (transformers' expert parallelism has no tp), and
    the plan exports back to the very ep_plan it came from."""
    import warnings

    from shardplan.interop.hf import build_hf_model, from_hf_ep_plan, hf_ep_plan

    model, inputs, kwargs = build_hf_model(model_type, tiny=True)
    theirs = hf_ep_plan(model)
    assert "ep_dispatch_experts" in theirs.values(), theirs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = from_hf_ep_plan(model=model, mesh={"dp": 2, "ep": 2}, example_inputs=inputs, example_kwargs=kwargs)
    assert {r.style for r in plan.rules} == {"ep_experts", "replicate"}, plan.rules
    assert plan.estimate.collectives["forward"].all_to_all > 0
    ours, config = plan.to_hf_ep_plan(model)
    assert ours == theirs and config == {"ep_size": 2, "fsdp_size": 4}


def test_an_ep_plan_import_that_cannot_be_honoured_is_refused() -> None:
    from shardplan.interop.hf import build_hf_model, from_hf_ep_plan

    model, inputs, kwargs = build_hf_model("mixtral", tiny=True)
    with pytest.raises(ValueError, match=r"no tensor parallelism; got mesh \{'ep': 2, 'tp': 2\}"):
        from_hf_ep_plan(model=model, mesh={"ep": 2, "tp": 2}, example_inputs=inputs, example_kwargs=kwargs)
    with pytest.raises(ValueError, match=r"'colwise'\} are not expert-parallel styles"):
        from_hf_ep_plan({"model.layers.*.self_attn.q_proj": "colwise"}, model=model, mesh={"ep": 2},
                        example_inputs=inputs, example_kwargs=kwargs)
    with pytest.raises(ValueError, match=r"names model.layers.\*.mlp.gate ep_dispatch_experts, but shardplan cannot split"):
        from_hf_ep_plan({"model.layers.*.mlp.gate": "ep_dispatch_experts"}, model=model, mesh={"ep": 2},
                        example_inputs=inputs, example_kwargs=kwargs)
