"""Multi-head latent attention (DeepSeek-V3, Kimi K2): the shared rotary key, one per
token, is broadcast to every head; with heads split tp ways its gradient on each rank sums
that rank's heads only. The plan keeps q_b/kv_b colwise and o_proj rowwise, and the latent
projection that made the key sums those partial gradients (a reduce-scatter backward), its
norm's weight gradient all-reduced when backward ends.

Plans on meta; collectives counted on the fake process group; numerics on 2 gloo ranks
against one process (with the latent's gradient left unsummed they fail)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.validate import check_findings
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability.mla import latent_model


def _plan(tp: int, *, sequence_parallel: bool = False) -> tuple[torch.nn.Module, shardplan.Plan]:
    with torch.device("meta"):
        model = latent_model()
    tokens = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
    return model, shardplan.plan_model(model, {"tp": tp}, example_inputs=tokens, explain=False,
                                       sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
def test_latent_attention_splits_by_heads_and_sums_the_shared_key(tp: int) -> None:
    model, plan = _plan(tp)
    rules = {r.module.rsplit(".", 1)[1]: r for r in plan.rules if ".attn." in r.module}
    assert {k: r.style for k, r in rules.items()} == {
        "wq": "colwise", "wkv_a": "colwise_gather_output", "kv_norm": "replicated_with_grad_allreduce",
        "wkv_b": "colwise", "wo": "rowwise"}
    assert rules["wkv_a"].output_grad_partial and rules["wkv_b"].input_grad_partial
    assert rules["kv_norm"].input_layouts == "Replicate"
    assert [a.values for a in plan.attributes] == [{"n_heads": 4 // tp}]  # expand(-1, -1, self.n_heads, -1)
    assert check_findings(plan, model) == []
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert again.rules == plan.rules


@pytest.mark.parametrize("tp", [2, 4])
def test_latent_attention_simulates_as_predicted(tp: int) -> None:
    _, plan = _plan(tp)
    result = simulate(latent_model(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["backward"]["reduce_scatter"] == 2  # one per layer: the latent's gradient


def test_latent_attention_composes_with_sequence_parallel() -> None:
    """Sequence-parallel norms around it: the attention's input is gathered once where the
    attention receives it, the latent projection reads it from there, and the counts equal
    the prediction; on 2 gloo ranks it matches one process."""
    _, plan = _plan(2, sequence_parallel=True)
    styles = plan.module_styles()
    assert styles["layers.0.norm1"] == "sequence_parallel" and styles["layers.0.attn.wkv_b"] == "colwise", styles
    assert any(r.module == "layers.*.attn" and r.input_layouts == "Shard(1)" for r in plan.regions), plan.regions
    result = simulate(latent_model(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    run = verify("tests.portability.mla:latent_model", plan=plan, nproc=2, timeout_s=300)
    assert run.passed, run.summary() + "\n" + "\n".join(run.problems)


def test_hf_deepseek_v3_mla_is_split_by_heads() -> None:
    pytest.importorskip("transformers")
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model("deepseek_v3", tiny=True)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    styles = plan.module_styles()
    attn = "model.layers.0.self_attn"
    assert (styles[f"{attn}.q_b_proj"], styles[f"{attn}.kv_b_proj"], styles[f"{attn}.o_proj"]) == ("colwise", "colwise", "rowwise")
    assert not [w for w in plan.warnings if w.split(":")[0].endswith(("q_b_proj", "kv_b_proj", "o_proj"))], plan.warnings


@pytest.mark.parametrize("spec", ["tests.portability.mla:latent_model", "hf-tiny:deepseek_v3"])
def test_latent_attention_matches_one_process_on_gloo(spec: str) -> None:
    if spec.startswith("hf"):
        pytest.importorskip("transformers")
    result = verify(spec, nproc=2, timeout_s=300)
    assert any(r.output_grad_partial for r in result.plan.rules), result.plan.rules
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def _replicated_latent_plan(tp: int) -> shardplan.Plan:
    """The DeepSeek recipe's layout: the low-rank kv projection whole. Its output's gradient
    comes back Partial, so its weight's gradient is all-reduced when backward ends and its
    input's is summed by the attention's region with wq's."""
    with torch.device("meta"):
        model = latent_model()
    tokens = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
    return shardplan.price_styles(model, {"tp": tp}, {"layers.*.attn.wkv_a": "replicated_with_grad_allreduce"},
                                  example_inputs=tokens, sequence_parallel=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_replicated_latent_projection_simulates_as_predicted(tp: int) -> None:
    plan = _replicated_latent_plan(tp)
    rule = plan.rule_for("layers.0.attn.wkv_a")
    assert rule.style == "replicated_with_grad_allreduce" and rule.output_grad_partial
    assert plan.module_styles()["layers.0.attn.wkv_b"] == "colwise"
    result = simulate(latent_model(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["backward"]["reduce_scatter"] == 0  # nothing gathered, nothing to scatter back


def test_a_replicated_latent_projection_matches_one_process_on_gloo() -> None:
    """Outputs, every gradient and the weights after an optimizer step, on 2 gloo ranks."""
    result = verify("tests.portability.mla:latent_model", plan=_replicated_latent_plan(2), nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
