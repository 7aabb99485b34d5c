"""Fewer kv heads than tp: each kv head lives on the tp / kv_heads ranks whose query heads
read it, instead of gathering every attention Linear. By default every weight stays split
tp ways (``colwise_kv_gathered``: each rank computes a slice of its kv head, gathered across
the group); within a memory budget, the head's rows replicated on the group
(``colwise_kv_replicated``, as Megatron and vLLM do), which needs no forward collective.

Plans are made on the meta device; collectives are counted on the fake process group at
tp=4, 8 and 16 (and under FSDP at dp=2 x tp=4); numerics run on 4 gloo ranks against one
process (outputs and every gradient; a missing gradient sync fails them)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.validate import check_findings
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import kv_heads

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


REPLICATED = "colwise_kv_replicated"
STYLES = ["colwise_kv_gathered", REPLICATED]  # the default; pinned, as a memory budget chooses it


def _plan(factory, tp: int, *, sequence_parallel=None, style: str | None = None, **axes: int) -> tuple[torch.nn.Module, shardplan.Plan]:
    with torch.device("meta"):
        model = factory()
    if style == REPLICATED:
        pins = {"layers.*.attn.wk": REPLICATED, "layers.*.attn.wv": REPLICATED}
        return model, shardplan.price_styles(model, {**axes, "tp": tp}, pins, example_inputs=TOKENS,
                                             sequence_parallel=sequence_parallel)
    return model, shardplan.plan_model(model, {**axes, "tp": tp}, example_inputs=TOKENS, explain=False,
                                       sequence_parallel=sequence_parallel)


def _attention_styles(plan: shardplan.Plan) -> dict[str, tuple[str, int | None]]:
    return {r.module.rsplit(".", 1)[1]: (r.style, r.groups) for r in plan.rules if ".attn." in r.module}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(("factory", "tp", "local"), [
    (kv_heads.attribute_gqa, 4, {"n_heads": 2, "n_kv_heads": 1, "n_rep": 2}),  # 8 heads, 2 kv
    (kv_heads.enable_gqa, 4, {"n_heads": 2, "n_kv_heads": 1}),  # no repeat: sdpa's enable_gqa
    (kv_heads.sixteen_heads, 8, {"n_heads": 2, "n_kv_heads": 1, "n_rep": 2}),  # 16 heads of 16 wide
    (kv_heads.sixteen_heads, 16, {"n_heads": 1, "n_kv_heads": 1, "n_rep": 1}),
])
def test_kv_heads_are_grouped_and_nothing_is_gathered(factory, tp: int, local: dict, style: str) -> None:
    model, plan = _plan(factory, tp, style=style)
    assert _attention_styles(plan) == {
        "wq": ("colwise", None), "wk": (style, 2), "wv": (style, 2),
        "wo": ("rowwise", None)}, plan.rules
    assert [a.values for a in plan.attributes] == [local]
    assert not [w for w in plan.warnings if "all-gathered" in w or "whole" in w], plan.warnings
    assert check_findings(plan, model) == []


def test_every_weight_is_split_tp_ways_by_default() -> None:
    model, plan = _plan(kv_heads.sixteen_heads, 8)
    whole = sum(p.numel() * 4 for p in model.parameters())
    norms_and_biases = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n or n.endswith("down.bias"))
    assert plan.estimate.param_bytes_per_device == pytest.approx((whole - norms_and_biases) / 8 + norms_and_biases, rel=1e-6)


def test_replicated_kv_weights_are_priced_at_their_group_share() -> None:
    """Each rank holds one of the 2 kv heads (half of wk, wv), not 1/tp of them."""
    model, plan = _plan(kv_heads.sixteen_heads, 8, style=REPLICATED)
    whole = sum(p.numel() * 4 for p in model.parameters())
    attn = model.layers[0].attn
    kv = sum(p.numel() * 4 for m in (attn.wk, attn.wv) for p in m.parameters())
    # everything else splits 8 ways but norms, biases of rowwise Linears and the layers' kv
    norms_and_biases = sum(p.numel() * 4 for n, p in model.named_parameters()
                           if "norm" in n or n.endswith(("down.bias",)))
    expected = (whole - 2 * kv - norms_and_biases) / 8 + 2 * kv / 2 + norms_and_biases
    assert plan.estimate.param_bytes_per_device == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(("factory", "tp"), [(kv_heads.attribute_gqa, 4), (kv_heads.sixteen_heads, 8),
                                             (kv_heads.sixteen_heads, 16)])
def test_simulated_collectives_equal_the_prediction(factory, tp: int, style: str) -> None:
    """Replicated, the kv weights' gradients are Partial over the ranks of each group: one
    bucketed all-reduce when backward ends; gathered, an all-gather over the group forward
    and a reduce-scatter backward per projection. The prediction counts both."""
    _, plan = _plan(factory, tp, style=style)
    assert plan.rule_for("layers.0.attn.wk").style == style
    model = factory()
    result = simulate(model, plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    k = model.layers[0].attn.wk.weight
    rows = k.shape[0] // 2 if style == "colwise_kv_replicated" else k.shape[0] // tp
    assert k.to_local().shape[0] == rows


@pytest.mark.parametrize("style", STYLES)
def test_kv_heads_in_groups_compose_with_sequence_parallel(style: str) -> None:
    """Sequence-parallel norms before the attention: its input is all-gathered once on entry
    (the region), and the kv projections read it like the q projection."""
    _, plan = _plan(kv_heads.attribute_gqa, 4, sequence_parallel=True, style=style)
    styles = plan.module_styles()
    assert styles["layers.0.norm1"] == "sequence_parallel"
    assert styles["layers.0.attn.wk"] == styles["layers.0.attn.wv"] == style
    result = simulate(kv_heads.attribute_gqa(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("style", STYLES)
def test_fully_sharded_kv_heads_simulate_as_predicted(style: str) -> None:
    _, plan = _plan(kv_heads.attribute_gqa, 4, dp=2, style=style)
    model = kv_heads.attribute_gqa()
    result = simulate(model, plan, (torch.randint(0, 128, (2, 16)),), fsdp=True)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_groups_are_validated(tmp_path) -> None:
    model, plan = _plan(kv_heads.attribute_gqa, 4)
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert _attention_styles(again) == _attention_styles(plan)
    bad = again.model_copy(update={"rules": [r.model_copy(update={"groups": 3}) if r.groups else r for r in again.rules]})
    findings = check_findings(bad, model)
    assert findings and "groups 3 must divide tp=4" in findings[0], findings


def test_hf_qwen3_moe_at_tp4_keeps_its_two_kv_heads_on_two_ranks_each() -> None:
    pytest.importorskip("transformers")
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model("qwen3_moe", tiny=True)
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    styles = plan.module_styles()
    assert styles["model.layers.0.self_attn.k_proj"] == styles["model.layers.0.self_attn.v_proj"] == "colwise_kv_gathered"
    assert (styles["model.layers.0.self_attn.q_proj"], styles["model.layers.0.self_attn.o_proj"]) == ("colwise", "rowwise")
    assert styles["model.layers.0.self_attn.k_norm"] == "replicated_with_grad_allreduce"
    assert plan.attributes[0].values == {"num_key_value_groups": 1}, plan.attributes


@pytest.mark.parametrize(("spec", "sp", "style"), [
    ("tests.portability.kv_heads:attribute_gqa", True, REPLICATED),
    ("tests.portability.kv_heads:attribute_gqa", None, "colwise_kv_gathered"),
    ("hf-tiny:qwen3_moe", None, "colwise_kv_gathered"),
])
def test_kv_heads_match_one_process_on_four_gloo_ranks(spec: str, sp, style: str) -> None:
    if spec.startswith("hf"):
        pytest.importorskip("transformers")
    if style == REPLICATED:
        result = verify(spec, plan=_plan(kv_heads.attribute_gqa, 4, sequence_parallel=sp, style=style)[1], nproc=4,
                        timeout_s=300)
    else:
        result = verify(spec, nproc=4, timeout_s=300, sequence_parallel=sp)
    assert style in set(result.plan.module_styles().values()), result.plan.module_styles()
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_plan_with_kv_heads_in_groups_is_not_handed_to_hugging_face() -> None:
    _, plan = _plan(kv_heads.attribute_gqa, 4)
    with pytest.raises(ValueError, match="tp_plan cannot express.*apply_plan"):
        plan.to_hf_tp_plan()
    _, plain = _plan(kv_heads.attribute_gqa, 2)  # 2 kv heads at tp=2: stock styles
    # ... but this model sizes its views by self.n_heads, which Hugging Face's loader leaves global
    with pytest.raises(ValueError, match=r"layers\.\*\.attn: the plan gives its code per-rank sizes"):
        plain.to_hf_tp_plan()
    assert "layers.*.attn.wk" in plain.model_copy(update={"attributes": []}).to_hf_tp_plan()
