"""Expert parallelism on gloo ranks (``shardplan.apply.experts_ep``): whole experts per rank over
an ``ep`` axis, tokens dispatched by all-to-all, against one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import tests._ep_workers as w
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


def test_an_ep_that_does_not_divide_the_experts_is_refused() -> None:
    with fake_process_group(3):
        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
        with pytest.raises(ValueError, match="4 experts, which ep=3 does not divide"):
            parallelize_module(w.TinyBank(), mesh, ExpertParallel())


def test_a_bank_not_called_with_its_routing_is_refused() -> None:
    """Llama 4's bank takes every token pre-scaled (``forward(hidden)``): not this dispatch."""

    class EveryToken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 12))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 6, 8))

        def forward(self, hidden):
            return hidden

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        with pytest.raises(ValueError, match="top_k_index"):
            parallelize_module(EveryToken(), mesh, ExpertParallel())


# --- planned: plan_model on a mesh with an ep axis, apply_plan, fully_shard_plan -------------

def _plan(model_type: str, mesh: dict, **options):
    import shardplan
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model(model_type, tiny=True)
    return shardplan.plan_model(model, mesh, example_inputs=inputs, explain=False, **options)


@pytest.fixture(scope="module")
def planned() -> dict:
    cases = [(t, _plan(t, {"ep": 2}).to_yaml()) for t in TYPES]
    return {"ep": run_on_gloo(w.planned_families, world_size=2, args=(cases, True, ("ep",)), timeout_s=400),
            "dp_ep": run_on_gloo(w.planned_families, world_size=4, timeout_s=400,
                                 args=([("mixtral", _plan("mixtral", {"dp": 2, "ep": 2}).to_yaml())], True, ("dp", "ep")))}


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
        assert max(got["weights"].values()) < 5e-5, sorted(got["weights"].items(), key=lambda kv: -kv[1])[:3]
        banks = {n: p for n, p in got["placements"].items() if ".experts." in n}
        assert banks and set(banks.values()) == {"(Shard(dim=0),)"}, banks


def test_planned_dp_and_ep_shard_experts_over_dp_and_the_rest_over_both(planned: dict) -> None:
    """{dp: 2, ep: 2} on 4 ranks: the banks Shard(0) over ep and FSDP over dp; dense modules
    HSDP (replicated over dp, sharded over ep); all equal to one process on the whole batch."""
    for result in planned["dp_ep"]:
        got = result["mixtral"]
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, got["grads"]
        assert max(got["weights"].values()) < 5e-5
        assert got["placements"]["model.layers.0.mlp.experts.down_proj"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert got["placements"]["model.layers.0.self_attn.q_proj.weight"] == "(Replicate(), Shard(dim=0))"


@pytest.mark.parametrize("model_type, mesh, message", [
    ("llama", {"ep": 2}, "has no expert bank"),
    ("mixtral", {"ep": 3}, "which ep=3 does not divide"),
    ("mixtral", {"ep": 2, "tp": 2}, "not supported yet"),
    ("llama4_text", {"ep": 2}, "not as a routed bank"),
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


@pytest.mark.parametrize("mesh", [{"ep": 64}, {"dp": 2, "ep": 32}])
@pytest.mark.parametrize("fsdp", [False, True])
def test_simulated_collectives_at_64_ranks_equal_the_prediction(mesh: dict, fsdp: bool) -> None:
    """On the fake group (its all-to-all hands each rank back what it sent, so every count and
    shape stays consistent), 64 experts over 64 or 32 ranks: the count exchange and the four
    row exchanges per MoE layer, and under FSDP the dense units over dp x ep and the banks
    over dp, as the estimate predicts them."""
    import shardplan
    from shardplan.interop.hf import build_hf_model
    from shardplan.interop.hf_models import hf_config, shrink_config, transformers_module
    from shardplan.tools.simulate import simulate

    cfg = hf_config(transformers_module(), "mixtral", None)
    shrink_config(cfg)
    cfg.num_local_experts = 64
    model, inputs, _ = build_hf_model("mixtral", device="cpu", config=cfg, batch_size=8)
    plan = shardplan.plan_model(model, mesh, example_inputs=inputs, explain=False)
    result = simulate(model.float(), plan, inputs, fsdp=fsdp)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["forward"]["all_to_all"] == 3 * cfg.num_hidden_layers
