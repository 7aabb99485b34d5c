"""Expert parallelism of experts written as an ``nn.ModuleList`` (issue 31 item 2): planned,
priced, counted on the fake group, matched against one process on gloo, checkpointed.

The models (``tests/portability/listed_experts.py`` and ``routed_experts.py``) write the
loop as public code does: mistral's reference Mixtral, DeepSeek's inference code (counts read
with ``.tolist()``, idle experts skipped, a shared expert), a loop over the experts hit (top-1
by argmax, the residual inside the MoE module), and a loop with ``index_add_``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import shardplan
from shardplan.tools.launch import run_on_gloo
from tests import _listed_workers as w
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import user_moe
from tests.portability.listed_experts import gated_moe as GATED

MISTRAL, DEEPSEEK, HIT, NAMED, SEQUENTIAL = (f"tests.portability.listed_experts:{n}" for n in (
    "mistral_moe", "deepseek_moe", "hit_moe", "named_moe", "sequential_moe"))
INDEX_ADD = "tests.portability.routed_experts:moe_lm"
USER_MOE = "tests.portability.user_moe:user_moe"
PARAM, COUNTED = (f"tests.portability.listed_experts:{n}" for n in ("param_moe", "counted_gate_moe"))
VOCAB = {MISTRAL: 96, DEEPSEEK: 96, HIT: 96, INDEX_ADD: 128, NAMED: 96, SEQUENTIAL: 96, PARAM: 96, COUNTED: 96}
EXPERTS = {MISTRAL: 4, DEEPSEEK: 8, HIT: 4, INDEX_ADD: 4, NAMED: 4, SEQUENTIAL: 4}


def _inputs(spec: str, batch: int = 4) -> tuple:
    return (torch.randint(0, VOCAB[spec], (batch, 16), generator=torch.Generator().manual_seed(0)),)


def _plan(spec: str, mesh: dict, **options):
    return shardplan.plan_model(w._build(spec), mesh=mesh, example_inputs=_inputs(spec), explain=False, **options)


def _lists(spec: str) -> str:
    return "moes.*.experts" if spec == INDEX_ADD else "layers.*.feed_forward.experts"


@pytest.mark.parametrize("spec", [MISTRAL, DEEPSEEK, HIT, INDEX_ADD, NAMED, SEQUENTIAL])
def test_a_list_of_experts_plans_over_ep_by_whole_experts_and_nothing_else(spec: str) -> None:
    plan = _plan(spec, {"ep": 2})
    split = [r for r in plan.rules if r.style == "ep_experts"]
    assert [(r.module, r.num_experts) for r in split] == [(_lists(spec), EXPERTS[spec])], plan.rules
    assert {r.style for r in plan.rules} == {"ep_experts", "replicate"}, "ep is a data axis for every other module"
    assert "record" in split[0].why and "all-to-all" in split[0].why
    layers = 2
    assert plan.estimate.collectives["forward"].all_to_all == 3 * layers  # counts, rows there, rows back
    assert plan.estimate.collectives["backward"].all_to_all == 2 * layers
    whole = _plan(spec, {"dp": 2, "tp": 1}).estimate.param_bytes_per_device
    experts = sum(p.numel() * 4 for n, p in w._build(spec).named_parameters() if ".experts." in n)
    assert plan.estimate.param_bytes_per_device == pytest.approx(whole - experts / 2)


def test_ep_with_tp_splits_attention_by_heads_beside_the_experts() -> None:
    """DeepSeek's layer reads its token counts with ``.tolist()``, which meta tensors cannot:
    the local check stands that layer in and still checks the attention around it, which is
    split by heads with the local head count (it was run whole before)."""
    plan = _plan(DEEPSEEK, {"ep": 2, "tp": 2})
    styles = plan.module_styles()
    assert styles["layers.0.wq"] == "colwise" and styles["layers.0.wo"] == "rowwise", styles
    assert styles["layers.0.feed_forward.experts.0.w1"] == "colwise"
    assert [a.values for a in plan.attributes] == [{"heads": 2}]
    assert not [x for x in plan.warnings if "check skipped" in x or "runs on whole" in x], plan.warnings


@pytest.mark.parametrize("spec, mesh, fsdp", [
    (INDEX_ADD, {"ep": 2}, False), (INDEX_ADD, {"ep": 4}, True), (INDEX_ADD, {"dp": 2, "ep": 2, "tp": 2}, True),
    (MISTRAL, {"ep": 2, "tp": 2}, False), (DEEPSEEK, {"ep": 2}, False), (DEEPSEEK, {"dp": 2, "ep": 2}, True),
    (DEEPSEEK, {"ep": 2, "tp": 2}, False), (HIT, {"ep": 4}, True)])
def test_simulated_collectives_equal_the_prediction(spec: str, mesh: dict, fsdp: bool) -> None:
    """One dispatch per layer call whatever the loop skipped: the count exchange and four row
    exchanges; the tp collectives of each rank's E/ep experts, once each; the layer's other
    tp collectives twice (the record pass); under FSDP each held expert its own unit."""

    model, inputs = w._build(spec), _inputs(spec)
    plan = shardplan.plan_model(model, mesh=mesh, example_inputs=inputs, explain=False)
    result = simulate(model, plan, inputs, fsdp=fsdp)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["forward"]["all_to_all"] == 6


def _gloo(spec: str, mesh: dict, fsdp: bool) -> list[dict]:
    plan = _plan(spec, mesh, data_parallel="fsdp" if fsdp else "ddp")
    world = 1
    for n in mesh.values():
        world *= n
    return run_on_gloo(w.matches, world_size=world, args=(spec, plan.to_yaml(), fsdp, 2, False), timeout_s=300)


@pytest.mark.parametrize("spec, mesh, fsdp", [
    (MISTRAL, {"ep": 2}, False), (DEEPSEEK, {"ep": 2}, False), (HIT, {"ep": 2}, False), (INDEX_ADD, {"ep": 2}, False),
    (MISTRAL, {"ep": 2, "tp": 2}, False), (DEEPSEEK, {"ep": 2, "tp": 2}, False), (DEEPSEEK, {"dp": 2, "ep": 2}, True),
    (NAMED, {"ep": 2}, False), (SEQUENTIAL, {"ep": 2}, True)])
def test_listed_experts_over_ep_match_one_process(spec: str, mesh: dict, fsdp: bool) -> None:
    """Each data rank its own rows: logits, every gradient a rank holds (dense ones averaged
    over the data ranks, by hand or by FSDP), and the weights after 2 AdamW steps equal one
    process on the whole batch, and so do the logits of an eval forward under no_grad on
    another batch size; each rank holds E/ep experts and none of the others'."""
    for got in _gloo(spec, mesh, fsdp):
        assert got["logits"] < 1e-5 and max(got["grads"].values()) < 1e-5, (got["logits"], got["grads"])
        assert not got["missing_grads"], got["missing_grads"]
        assert max(got["weights"].values()) < 5e-4, sorted(got["weights"].items(), key=lambda kv: -kv[1])[:3]
        assert got["eval_logits"] < 1e-4, got["eval_logits"]  # no_grad, eval, 3 rows per rank
        held, per_expert = EXPERTS[spec] // mesh["ep"], 3
        assert got["experts_here"] == 2 * held
        assert got["held_elsewhere"] == 2 * (EXPERTS[spec] - held) * per_expert
        assert not set(got["names"]) & set(got["elsewhere_names"])


def test_checkpoints_saved_at_ep_2_load_exactly_at_ep_4_and_unsharded(tmp_path) -> None:
    """DCP at ep=2 (each key written by the rank holding that expert), loaded at ep=4 and into
    the plain model: every tensor equal, optimizer moments too; ``full_state_dict`` gathers
    the unsharded model's keys in its order; ``load_full_state_dict`` and ``load_checkpoint``
    of a safetensors file load each rank's experts, into a model built on meta too."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    spec, folder = MISTRAL, str(tmp_path / "dcp")
    saved = run_on_gloo(w.save_at, world_size=2, args=(spec, _plan(spec, {"ep": 2}).to_yaml(), folder), timeout_s=300)
    plain = w._build(spec)
    full = saved[0]["full"]
    assert list(full) == list(plain.state_dict()), "the unsharded model's keys, in its order"
    assert all(torch.equal(full[k], saved[1]["full"][k]) for k in full)
    assert not set(saved[0]["held"]) & {k for k in saved[1]["held"] if ".experts." in k}, "no expert on both ranks"
    loaded = run_on_gloo(w.load_at, world_size=4, args=(spec, _plan(spec, {"ep": 4}).to_yaml(), folder), timeout_s=300)
    for got in loaded:
        assert all(torch.equal(got["full"][k], full[k]) for k in full)
        assert got["moments"] and all(v.abs().sum() > 0 for v in got["moments"].values())
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    assert all(torch.equal(state["model"][k], full[k]) for k in full)
    save_file({k: v.contiguous() for k, v in full.items()}, str(tmp_path / "model.safetensors"))
    back = run_on_gloo(w.round_trip, world_size=2, args=(spec, _plan(spec, {"ep": 2}).to_yaml(), str(tmp_path)),
                       timeout_s=300)
    for got in back:
        assert all(torch.equal(got[way][k], full[k]) for way in ("state_dict", "checkpoint", "meta") for k in full)
    assert not set(back[0]["meta_held"]) & {k for k in back[1]["meta_held"] if ".experts." in k}


def test_a_plan_file_round_trips_and_hugging_face_export_is_refused() -> None:
    from shardplan.plan.validate import check_findings

    plan = _plan(MISTRAL, {"ep": 2})
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert again.rules == plan.rules
    assert check_findings(again, w._build(MISTRAL)) == []
    wrong = again.model_copy(update={"rules": [r.model_copy(update={"num_experts": 8}) if r.style == "ep_experts" else r
                                               for r in again.rules]})
    assert any("lists 4 experts" in f for f in check_findings(wrong, w._build(MISTRAL)))
    with pytest.raises(ValueError, match="list of expert modules"):
        plan.to_hf_ep_plan(w._build(MISTRAL))


@pytest.mark.parametrize("mesh, message", [({"ep": 3}, r"4 experts, which ep=3 does not divide; use an ep of \[2, 4\]")])
def test_an_ep_that_does_not_divide_the_listed_experts_is_refused(mesh: dict, message: str) -> None:
    with pytest.raises(shardplan.PlanningError, match=message):
        _plan(MISTRAL, mesh)


def test_a_layer_that_feeds_one_expert_to_another_is_refused_on_the_ranks() -> None:
    """Replay hands back what the record pass's rows gave; rows that differ (an expert's
    output fed to the next) raise instead of returning outputs of the wrong rows."""
    from torch import nn

    from shardplan.apply.experts_listed import shard_listed_experts
    from shardplan.apply.mesh import fake_process_group, make_mesh

    class Chained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(8, 2)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            return self.experts[1](self.experts[0](x)) * self.router(x)[:, :1]

    layer = Chained()
    with fake_process_group(2):
        shard_listed_experts(layer, "experts", make_mesh({"ep": 2})["ep"])
        with pytest.raises(RuntimeError, match="must not depend on experts' outputs"):
            layer(torch.randn(4, 8))


def test_the_cli_plans_an_ep_mesh_for_a_list_of_experts() -> None:
    """``--mesh ep=2`` counts experts per device; ``--world-size 4`` compares meshes with ep."""
    out = subprocess.run([sys.executable, "-m", "shardplan", "plan", MISTRAL, "--mesh", "ep=2", "--seq", "16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ep_experts" in out.stdout and "4 experts" in out.stdout and "2 experts" in out.stdout, out.stdout
    splits = subprocess.run([sys.executable, "-m", "shardplan", "plan", MISTRAL, "--world-size", "4", "--seq", "16"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert splits.returncode == 0 and "ep=4" in splits.stdout and "ep=2,tp=2" in splits.stdout, splits.stderr


def test_verify_and_the_cli_build_a_model_whose_trace_needs_its_weights_on_the_cpu() -> None:
    """DeepSeek's layer counts its tokens per expert from the router's output: on meta
    weights there are no values, so the CLI and verify build the (small) model again on the
    CPU to plan it, instead of stopping at "build the model on CPU" with no way to."""

    result = verify(DEEPSEEK, nproc=4, mesh={"ep": 2, "tp": 2}, seq_len=16, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    out = subprocess.run([sys.executable, "-m", "shardplan", "plan", DEEPSEEK, "--mesh", "ep=2", "--seq", "16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ep_experts" in out.stdout, out.stderr


def test_a_router_read_only_by_argmax_gets_no_gradient_and_no_backward_collective() -> None:
    """Top-1 by ``argmax`` with no routing weight: no gradient reaches the router, so its
    style's backward collective (an all-gather of its input's gradient) never runs; the
    estimate counts what the fake group counts."""

    model, inputs = w._build(HIT), _inputs(HIT)
    plan = shardplan.plan_model(model, mesh={"tp": 2}, example_inputs=inputs, explain=False)
    assert plan.module_styles()["layers.0.feed_forward.router"] == "rowwise_split_input"
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert plan.estimate.collectives["backward"].all_gather == 0


def test_stacked_layers_after_a_linear_of_as_many_outputs_are_not_experts() -> None:
    """A list whose second entry reads the first's output is a stack of layers, even after a
    Linear with as many outputs as the list has entries: no ep rule, an ep mesh refused."""
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pick = nn.Linear(8, 2)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            x = x * self.pick(x).softmax(-1)[..., :1]
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(shardplan.PlanningError, match="has no expert bank"):
        shardplan.plan_model(Stack(), {"ep": 2}, example_inputs=(torch.randn(4, 8),), explain=False)


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"ep": 2, "tp": 2}])
def test_experts_the_example_leaves_idle_are_planned_as_their_neighbours(mesh: dict) -> None:
    """Every token of the example alike: DeepSeek's loop skips the idle experts, expert 0 among
    them, so the first expert that runs stands for the list (planning raised a KeyError on the
    never-called first one)."""
    model = w._build(DEEPSEEK)
    idle = shardplan.plan_model(model, mesh, example_inputs=(torch.zeros(2, 16, dtype=torch.long),), explain=False)
    assert idle.module_styles() == _plan(DEEPSEEK, mesh).module_styles()
    assert idle.module_styles()["layers.0.feed_forward.experts.0.w2"] == "rowwise"


def test_experts_called_with_more_than_their_rows_are_refused_over_ep() -> None:
    """``expert(x[idx], w[idx])``: the dispatch sends each expert one tensor of rows, so the
    weights would not reach it on another rank (planned before, the ranks raised); refused
    when planning, with the call named. On tp alone each expert is split inside as usual."""
    from tests.portability.listed_experts import weighted_moe

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(shardplan.PlanningError, match=r"expert 0 is called with 2 tensors"):
        shardplan.plan_model(weighted_moe(), {"ep": 2}, example_inputs=(tokens,), explain=False)
    plan = shardplan.plan_model(weighted_moe(), {"tp": 2}, example_inputs=(tokens,), explain=False)
    assert plan.module_styles()["layers.0.feed_forward.experts.0.w1"] == "colwise"


def test_a_router_module_with_a_raw_weight_and_grouped_top_k_routes_the_list() -> None:
    """DeepSeek-V3's gate as a module (a raw weight [E, H], a top-2 per expert group before
    the routing top-3) returns the chosen experts, not E scores: the list was not found and
    ep was refused. It is a router now, and k is the top-k over the E experts (3), not the
    first top-k of the layer (the groups' 2). On 2 gloo ranks it matches one process."""

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = shardplan.plan_model(GATED(), {"ep": 2}, example_inputs=(tokens,), explain=False)
    rule = next(r for r in plan.rules if r.style == "ep_experts")
    assert (rule.module, rule.num_experts) == ("layers.*.feed_forward.experts", 8)
    assert f"{2 * 16 * 3 * 32} elements" in rule.why, rule.why  # T k H
    result = verify("tests.portability.listed_experts:gated_moe", plan=plan, nproc=2, timeout_s=300, seq_len=16)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_experts_of_raw_parameters_are_refused_over_ep_when_planning() -> None:
    """The dispatch reads an expert's row width off its first Linear: experts of raw
    parameters (``x @ self.w_in``) planned over ep before and the ranks raised."""
    from tests.portability.listed_experts import param_moe

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(shardplan.PlanningError, match=r"ParamExpert\) hold no Linear"):
        shardplan.plan_model(param_moe(), {"ep": 2}, example_inputs=(tokens,), explain=False)



@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_deepseeks_reference_layer_plans_on_meta_and_keeps_the_block_split(device: str) -> None:
    """DeepSeek-V3's reference layer (a gate module, ``bincount(...).tolist()``, idle experts
    skipped): on meta the counts are taken at their upper bound (every expert receives every
    token), so a model too big for the CPU plans (it stopped at "build the model on CPU"); on
    the CPU the block's check stands the layer in and its attention stays split by heads
    (the stand-in hid the gate its plan names, the check failed, and the whole block ran
    gathered)."""
    from tests.portability.listed_experts import counted_gate_moe

    with torch.device(device):
        model = counted_gate_moe()
    tokens = torch.zeros(4, 16, dtype=torch.long, device=device)
    for mesh in ({"tp": 2}, {"ep": 2}):
        plan = shardplan.plan_model(model, mesh, example_inputs=(tokens,), explain=False)
        styles = plan.module_styles()
        assert not [w for w in plan.warnings if "whole activations" in w or "skipped" in w], plan.warnings
        if mesh == {"tp": 2}:
            assert [styles[f"layers.0.{n}"] for n in ("wq", "wk", "wv", "wo")] == ["colwise"] * 3 + ["rowwise"]
        else:
            assert {r.module: r.style for r in plan.rules}["layers.*.feed_forward.experts"] == "ep_experts"
    if device == "meta":
        assert any("bincount" in w and "every expert receives every token" in w for w in plan.warnings), plan.warnings


def test_deepseeks_reference_layer_matches_one_process_on_gloo() -> None:

    result = verify("tests.portability.listed_experts:counted_gate_moe", nproc=2, mesh={"ep": 2}, seq_len=16,
                    timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)




@pytest.mark.parametrize("spec, moe", [(USER_MOE, "blocks.*.moe"), (MISTRAL, "layers.*.feed_forward")])
def test_a_users_moe_summing_experts_into_zeros_keeps_sequence_parallel_and_matches_on_gloo(spec: str, moe: str) -> None:
    """A MoE written from scratch (``out = zeros_like(flat)``, ``out.index_add_(0, rows,
    expert(flat[rows]) * w)``, a shared expert added, ``view(B, T, C)`` back) or as mistral's
    reference (``results[rows] += w * expert(x[rows])``, ``results.view_as(inputs)``): zeros
    are a partial sum, and adding or writing partial sums at whole rows keeps one, so the
    experts' sums are reduce-scattered once where the MoE returns. Before, sequence_parallel=True
    raised: top-k's integer indices, and the input ``type_as``/``view_as`` read for its dtype
    and shape, were marked as needing their gradient summed."""
    result = verify(spec, nproc=2, seq_len=32, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    styles = {re.sub(r"\.\d+\.", ".*.", m): s for m, s in result.plan.module_styles().items()}
    assert "sequence_parallel" == styles[moe.rpartition(".")[0] + ".ffn_norm"], styles
    assert (styles[moe + ".experts.*.w1"], styles[moe + ".experts.*.w2"]) == ("colwise", "rowwise"), styles
    exit_ = [r for r in result.plan.regions if r.module == moe and r.input == "output"]
    assert [(r.input_layouts, r.desired_input_layouts) for r in exit_] == [("Partial", "Shard(1)")], result.plan.regions
    if spec != USER_MOE:
        return
    with torch.device("meta"):
        model = user_moe.user_moe_no_skip()
    tokens = torch.zeros(2, 32, dtype=torch.long)
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(tokens.to("meta"),), sequence_parallel=True)
    counted = simulate(user_moe.user_moe_no_skip(), plan, (tokens,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("spec", [MISTRAL, DEEPSEEK, HIT, INDEX_ADD, NAMED, PARAM, COUNTED])
def test_every_listed_moe_keeps_its_norms_on_sequence_shards(spec: str) -> None:
    """sequence_parallel=True on every way the lists are written, at 16 tokens: each MoE
    gathers the tokens where it receives them and hands its sum back on sequence shards
    where it returns. Before, it raised for all but two: a routing weight's ``type_as(x)``
    counted as a reader of the shard (no gather site), DeepSeek's stood-in MoE (counts read
    with ``.tolist()``) returned the unconverted shape to the check, raw-parameter experts'
    whole output could not be cut inside a block, and a stack of MoE modules with no block
    around them (``x = x + moe(norm(x))``) read its folded copies' outputs unconverted."""
    plan = _plan(spec, {"tp": 2}, sequence_parallel=True)
    norms = {m: s for m, s in plan.module_styles().items() if "norm" in m}
    assert norms and set(norms.values()) == {"sequence_parallel"}, (norms, plan.warnings)


@pytest.mark.parametrize("spec", [DEEPSEEK, INDEX_ADD, PARAM])
def test_listed_moes_under_sequence_parallel_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, seq_len=16, timeout_s=300, sequence_parallel=True)
    assert "sequence_parallel" in result.plan.module_styles().values(), result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_users_moe_sums_its_experts_once_where_it_returns_without_sequence_parallel() -> None:
    """Without sequence parallel the same MoE all-reduced each expert's output (forward 14
    all-reduces at tp=4: one per expert and layer, the shared expert's, attention's); its
    experts' partial sums now flow through ``index_add_`` and are all-reduced once where the
    block returns (``P>R``), and the counted collectives equal the prediction."""
    with torch.device("meta"):
        model = user_moe.user_moe_no_skip()
    tokens = torch.zeros(2, 32, dtype=torch.long)
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(tokens.to("meta"),))
    assert "sequence_parallel" not in plan.module_styles().values()
    exit_ = [(r.input_layouts, r.desired_input_layouts) for r in plan.regions if r.module == "blocks.*.moe"]
    assert exit_ == [("Partial", "Replicate")], plan.regions
    assert plan.estimate.collectives["forward"].all_reduce == 6, plan.estimate.collectives
    counted = simulate(user_moe.user_moe_no_skip(), plan, (tokens,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
