"""Fused projections cut into equal parts by the ops after them, each the packed style:
``split(self.n_embd)`` (nanoGPT), slices ``qkv[..., :q_pos]`` (phi3), ``reshape(B, N, 3,
heads, head_dim)`` (timm's ViT). Plans on meta at tp=2 and 4 (every rank holds its slice
of q, k and v, the widths and head counts the code sizes by made local), numerics on 2
gloo ranks, and a GQA ``split([q, kv, kv])`` of unequal parts, which no DTensor placement
can hold, gathered with a warning that names the split; the same GQA projection grouped
per kv head (Megatron's layout) is plain colwise."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.apply.mesh import fake_process_group, make_mesh
from shardplan.tools.verify import verify
from tests.portability import fused

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
LOCAL = {  # the attributes each attention's code sizes by, at tp
    "split_by_width": lambda tp: {"n_embd": 64 // tp, "n_head": 8 // tp},
    "equal_slices": lambda tp: {"kv_width": 64 // tp, "n_embd": 64 // tp, "q_pos": 64 // tp, "n_head": 8 // tp},
    "reshape_three": lambda tp: {"n_embd": 64 // tp, "n_head": 8 // tp},
    "einops_three": lambda tp: {"n_head": 8 // tp},
}


def _plan(name: str, tp: int) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(fused, name)()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(LOCAL))
def test_equal_parts_are_packed(name: str, tp: int) -> None:
    plan = _plan(name, tp)
    qkv, proj = plan.rule_for("layers.0.attn.qkv"), plan.rule_for("layers.0.attn.proj")
    assert (qkv.style, qkv.packed, proj.style) == ("packed_colwise", 3, "rowwise"), (qkv, proj)
    # the export front end (einops) folds the layers too: one entry for the stack
    want = [("layers.*.attn", LOCAL[name](tp))]
    assert [(a.module, a.values) for a in plan.attributes] == want
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize(("name", "style"), [("split_by_width", "packed_colwise"), ("reshape_three", "packed_colwise"),
                                           ("einops_three", "packed_colwise"),
                                           ("phi3_equal_heads", "packed_colwise"), ("grouped_per_kv", "colwise")])
def test_fused_projections_match_one_process_on_gloo(name: str, style: str) -> None:
    result = verify(f"tests.portability.fused:{name}", nproc=2, timeout_s=300)
    assert style in {r.style for r in result.plan.rules if r.module.endswith("qkv") or r.module.endswith("qkv_proj")}
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_config_count_is_made_local_for_that_module_alone() -> None:
    """phi3 slices q by ``self.config.num_attention_heads * self.head_dim``: the attention gets
    its own copy of the config with the local count; the model's config keeps the global one."""
    model = fused.phi3_equal_heads()
    plan = shardplan.plan_model(model, {"tp": 2}, batch_size=2, seq_len=16)
    (entry,) = plan.attributes
    assert entry.values["config.num_attention_heads"] == 2, entry
    with fake_process_group(2):
        shardplan.apply_plan(model, make_mesh({"tp": 2}), plan)
    attn = model.model.layers[0].self_attn
    assert (attn.config.num_attention_heads, model.config.num_attention_heads) == (2, 4)
    assert model.model.layers[1].self_attn.config is not model.config


@pytest.mark.parametrize("tp", [2, 4])
def test_rows_grouped_per_kv_head_are_colwise(tp: int) -> None:
    plan = _plan("grouped_per_kv", tp)
    assert [plan.rule_for(f"layers.0.attn.{n}").style for n in ("qkv", "proj")] == ["colwise", "rowwise"]
    assert [a.values for a in plan.attributes] == [{"n_embd": 64 // tp, "n_head": 8 // tp, "n_kv_head": 4 // tp}]
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_gqa_parts_are_packed_by_parts(tp: int) -> None:
    """``split([q_pos, kv_width, kv_width])`` of 8 query heads beside 4 kv heads: each rank
    holds its heads of every part ([q_r; k_r; v_r], ``packed: [2, 1, 1]``), the split's
    widths and head counts made local."""
    with torch.device("meta"):
        model = fused.split_gqa()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS)
    qkv, proj = plan.rule_for("layers.0.attn.qkv"), plan.rule_for("layers.0.attn.proj")
    assert (qkv.style, qkv.packed, proj.style) == ("packed_colwise", [2, 1, 1], "rowwise"), (qkv, proj)
    assert [a.values for a in plan.attributes] == [{"kv_width": 32 // tp, "n_embd": 64 // tp, "n_kv_head": 4 // tp,
                                                    "q_pos": 64 // tp, "n_head": 8 // tp}]
    assert not plan.warnings, plan.warnings


def test_unequal_gqa_parts_with_fewer_kv_heads_than_ranks_gather_each_kv_head_in_its_group() -> None:
    """4 kv heads on 8 ranks: the query heads split, each kv head gathered whole on the 2
    ranks whose query heads read it (``whole_parts: 2, groups: 4``, :mod:`shardplan.decide.tails`)."""
    with torch.device("meta"):
        model = fused.split_gqa()
    plan = shardplan.plan_model(model, {"tp": 8}, example_inputs=TOKENS)
    qkv = plan.rule_for("layers.0.attn.qkv")
    assert (qkv.style, qkv.packed, qkv.whole_parts, qkv.groups) == ("packed_colwise", [2, 1, 1], 2, 4), plan.warnings
    assert plan.rule_for("layers.0.attn.proj").style == "rowwise" and not plan.warnings, plan.warnings


def test_unequal_slices_of_phi3_are_packed_by_parts() -> None:
    """Phi-3 slices its qkv_proj ``[..., :query_pos]``, ``[query_pos:query_pos + kv]``, ``[...:]``
    (4 heads, 2 kv heads: q 64, k 32, v 32): the slices tile it, so each rank holds its heads of
    every part ([2, 1, 1]); at tp=4 each of the 2 kv heads is gathered on the 2 ranks reading it."""
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model("phi3", tiny=True)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs)
    qkv = plan.rule_for("model.layers.0.self_attn.qkv_proj")
    assert (qkv.style, qkv.packed) == ("packed_colwise", [2, 1, 1]) and not plan.warnings, plan.warnings
    assert plan.module_styles()["model.layers.0.self_attn.o_proj"] == "rowwise"
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=inputs, example_kwargs=kwargs)
    qkv = plan.rule_for("model.layers.0.self_attn.qkv_proj")
    assert (qkv.style, qkv.packed, qkv.whole_parts, qkv.groups) == ("packed_colwise", [2, 1, 1], 2, 2), plan.warnings
    assert plan.module_styles()["model.layers.0.self_attn.o_proj"] == "rowwise" and not plan.warnings, plan.warnings


def _parallel_plan(seq: int) -> shardplan.Plan:
    with torch.device("meta"):
        model = fused.parallel_blocks()
    return shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, seq, dtype=torch.long, device="meta"),),
                                explain=False, sequence_parallel=True)


def test_a_parallel_block_under_sequence_parallel_makes_its_widths_local() -> None:
    """The norm's output is gathered at the norm for attention and MLP alike, so the views the
    attention's widths are proven by run in the whole block: run alone, the attention was
    handed the sequence shard and no width passed, and the attention was gathered."""
    plan = _parallel_plan(64)
    styles = plan.module_styles()
    assert (styles["layers.0.ln"], styles["layers.0.attn.qkv"], styles["layers.0.attn.proj"]) == (
        "sequence_parallel", "packed_colwise", "rowwise"), styles
    assert [(a.module, a.values) for a in plan.attributes] == [("layers.*.attn", {"n_embd": 32, "n_head": 4})]
    assert not plan.warnings, plan.warnings


def test_a_parallel_block_under_sequence_parallel_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.fused:parallel_blocks", nproc=2, seq_len=64, sequence_parallel=True, timeout_s=300)
    assert result.plan.module_styles()["layers.0.ln"] == "sequence_parallel"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_parallel_block_reading_its_norms_device_still_gathers_once() -> None:
    """``.to(h.device)`` reads the norm's output for its device: that read kept the gather off
    the norm's output, so attention and MLP each all-gathered it (GPT-J's shared norm: 6
    all-gathers forward at 2 layers, 4 now), counted equal to predicted."""
    from shardplan.tools.simulate import simulate

    model = fused.cast_parallel_blocks()
    tokens = (torch.zeros(2, 64, dtype=torch.long),)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=tokens, explain=False, sequence_parallel=True)
    gathers = [(r.module, r.input) for r in plan.regions if r.input_layouts == "Shard(1)"]
    assert gathers == [("layers.*.ln", "output")], plan.regions
    assert simulate(fused.cast_parallel_blocks(), plan, tokens).matches
