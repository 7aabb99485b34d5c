"""Model code as people write it (issue 30): attention must plan split by heads, q/k/v
colwise (or packed) and the output projection rowwise, and match one process on gloo.
Models in ``tests/portability/natural.py``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardplan
from shardplan.plan.model import CutFix, Plan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import natural

SPLIT_BY_HEADS = {"qkv": "packed_colwise", "proj": "rowwise", "fc": "colwise", "out": "rowwise"}


def _plan(builder, tp: int, seq: int = 16) -> Plan:
    with torch.device("meta"):
        model = builder()
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)


def _block_styles(plan: Plan, prefix: str) -> dict[str, str]:
    return {k[len(prefix):]: v for k, v in plan.module_styles().items() if k.startswith(prefix)}


@pytest.mark.parametrize(("builder", "tp"), [
    (natural.inline, 2), (natural.inline_list, 2), (natural.inline_list, 4), (natural.inline_functional, 2),
])
def test_inline_block_reading_widths_off_its_input_is_split_by_heads(builder, tp: int) -> None:
    plan = _plan(builder, tp)
    styles = _block_styles(plan, "blocks.0.")
    assert {k: styles[k] for k in SPLIT_BY_HEADS} == SPLIT_BY_HEADS, plan.warnings
    # q, k, v = qkv(x).split(D, dim=-1), D read off the whole input: one split, D / tp
    (views,) = plan.local_views
    assert views.module == "blocks.*" and views.cuts == [CutFix(call=0, parts=tp)]
    assert not plan.warnings, plan.warnings


def test_inline_block_with_heads_tp_does_not_divide_says_so() -> None:
    plan = _plan(natural.inline, 4)  # 6 heads on 4 ranks
    styles = _block_styles(plan, "blocks.0.")
    assert styles["qkv"] == "colwise_gather_output" and styles["fc"] == "colwise", styles
    assert any("6 groups (heads)" in w and "tp=4 does not divide" in w for w in plan.warnings), plan.warnings


def test_sizes_read_off_a_sequence_split_input_keep_sequence_parallel_and_the_heads() -> None:
    """At seq 2048 the cost model puts the residual on sequence shards; ``B, T, D = x.shape``
    then reads T / tp, and ``q.view(B, T, H, D // H)`` of the gathered q holds as many
    elements as its tensor (it regroups rows, it does not fail). Each such view is named by
    its call and given the whole length back: the norms stay on sequence shards, the heads split."""
    plan = _plan(natural.inline, 2, seq=2048)
    styles = _block_styles(plan, "blocks.0.")
    assert {k: styles[k] for k in SPLIT_BY_HEADS} == SPLIT_BY_HEADS, plan.warnings
    assert styles["ln1"] == styles["ln2"] == plan.module_styles()["ln"] == "sequence_parallel", styles
    fixes = plan.local_views[0].fixes
    assert [(f.call, f.seq_dim, f.seq_parts) for f in fixes] == [(i, 1, 2) for i in range(4)], fixes
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize(("builder", "tp"), [
    (natural.inline, 2), (natural.inline_list, 4), (natural.inline_functional, 2), (natural.inline_mqa, 2),
    (natural.inline_mqa, 4), (natural.inline_made_mask, 2),
])
def test_inline_blocks_take_sequence_parallel_when_asked(builder, tp: int) -> None:
    torch.manual_seed(0)
    plan = _sp_plan(builder, tp, sequence_parallel=True)
    styles = plan.module_styles()
    norms = {m: s for m, s in styles.items() if m.rpartition(".")[2] in ("ln1", "ln2", "norm1", "norm2", "ln")}
    assert set(norms.values()) == {"sequence_parallel"}, norms
    attention = _block_styles(plan, "blocks.0.")
    assert attention.get("qkv", attention.get("q")) in ("packed_colwise", "colwise"), attention
    assert attention.get("proj", attention.get("o")) == "rowwise", attention
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_mask_made_from_a_length_read_off_sequence_shards_is_made_whole() -> None:
    """``torch.ones(T, T).tril()`` with T read off the block's sequence-split input: the
    factory call is named and its sizes given the whole length back."""
    plan = _sp_plan(natural.inline_made_mask, 2, sequence_parallel=True)
    (entry,) = plan.local_views
    assert [(f.function, f.call, f.args, f.parts) for f in entry.lengths] == [("ones", 0, [0, 1], 2)], entry
    assert "ones call 0 sizes [0, 1] x 2" in entry.why


def test_a_position_encoding_module_hands_its_output_cut_onto_sequence_shards() -> None:
    """The PyTorch tutorial's ``PositionalEncoding`` adds a buffer cut by the input's length:
    the embedding stays whole, the module's output is cut onto sequence shards where it returns
    (a local slice), and the blocks behind it, folded copies included, take sequence shards."""
    plan = _sp_plan(natural.sinusoidal, 2, sequence_parallel=True)
    styles = plan.module_styles()
    assert {styles[f"blocks.{i}.{n}"] for i in (0, 1) for n in ("norm1", "norm2")} == {"sequence_parallel"}, styles
    assert (styles["blocks.0.attn.qkv"], styles["blocks.0.attn.o"]) == ("packed_colwise", "rowwise"), plan.warnings
    cut = {(r.module, r.input_layouts, r.desired_input_layouts) for r in plan.regions if r.input == "output"}
    assert ("pos", "Replicate", "Shard(1)") in cut, plan.regions
    assert not plan.warnings, plan.warnings
    result = simulate(natural.sinusoidal(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("builder", [natural.learned_positions, natural.fixed_positions])
def test_a_position_table_sliced_in_the_model_code_is_cut_where_the_first_block_receives_the_sum(builder) -> None:
    """``tok(idx) + self.pos_emb[:, :T]`` in the model's own forward: no module returns the
    sum, so the first block receives it whole and cuts it onto sequence shards there (a local
    slice, its gradient all-gathered back), as Megatron scatters after its embeddings. The
    later blocks, folded copies of the first, receive the shards as they are. Before, every
    norm of the model stayed whole (sequence_parallel=True raised)."""
    plan = _sp_plan(builder, 2, sequence_parallel=True)
    styles = plan.module_styles()
    norms = {k: v for k, v in styles.items() if k.rpartition(".")[2] in ("norm1", "norm2", "norm")}
    assert set(norms.values()) == {"sequence_parallel"}, styles
    assert (styles["blocks.1.attn.qkv"], styles["blocks.1.attn.o"]) == ("packed_colwise", "rowwise"), plan.warnings
    cuts = [(r.module, r.input, r.desired_input_layouts) for r in plan.regions if r.input_layouts == "Replicate"
            and r.input != "output"]
    assert cuts == [("blocks.0", 0, "Shard(1)")], plan.regions  # the first block only
    assert not plan.warnings, plan.warnings
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_attention_called_beside_the_stack_is_checked_and_split_by_heads() -> None:
    """A Perceiver's two cross-attentions run in the model's forward, beside its stack of
    latent layers. The check ran the stack and the head only, so their ``reshape(b, n,
    self.heads, -1)`` ran on shards with the global head count, the ``-1`` halving each head:
    wrong numbers on the ranks, and no warning. Each module outside the stack is now checked
    as a block is, and its head count made local."""
    plan = _sp_plan(natural.perceiver, 2)
    styles = plan.module_styles()
    for m in ("encode", "decode", "layers.0"):
        assert (styles[f"{m}.to_q"], styles[f"{m}.to_kv"], styles[f"{m}.to_out"]) == ("colwise", "packed_colwise", "rowwise")
    local = {a.module: a.values for a in plan.attributes}
    assert local["encode"] == local["decode"] == {"heads": 2}, plan.attributes
    result = verify("tests.portability.natural:perceiver", nproc=2, timeout_s=300, seq_len=16)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("spec", ["tests.portability.natural:inline", "tests.portability.natural:inline_mqa",
                                  "tests.portability.natural:inline_made_mask", "tests.portability.natural:sinusoidal",
                                  "tests.portability.natural:learned_positions", "tests.portability.natural:inline_positions",
                                  "tests.portability.natural:torch_mha"])
def test_inline_blocks_under_sequence_parallel_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    norm = "blocks.0.ln1" if ("inline" in spec and not spec.endswith("mqa")) or "mha" in spec else "blocks.0.norm1"
    assert result.plan.module_styles()[norm] == "sequence_parallel", result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("spec", ["tests.portability.natural:last_token", "tests.portability.natural:mean_pooled",
                                  "tests.portability.natural:tied_functional"])
def test_an_output_read_across_the_sequence_keeps_sequence_parallel_and_matches_on_gloo(spec: str) -> None:
    """``lm_head(h[:, -1])`` and ``h.mean(dim=1)`` read the final norm's output across the
    sequence, ``F.linear(h, self.tok.weight)`` multiplies it in the model's own code: that norm
    stays on sequence shards and all-gathers where it returns. Before, no norm of the model
    could be on sequence shards (sequence_parallel=True raised)."""
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    styles = result.plan.module_styles()
    assert styles["blocks.0.norm1"] == styles["blocks.1.norm2"] == styles["norm"] == "sequence_parallel", styles
    assert next(r for r in result.plan.rules if r.module == "norm").output_layouts == "Replicate"
    assert (styles["blocks.0.attn.qkv"], styles["blocks.0.attn.o"]) == ("packed_colwise", "rowwise"), styles


def test_a_mask_cut_by_a_length_read_off_sequence_shards_drops_sequence_parallel_not_the_heads() -> None:
    """nanoGPT's path without flash cuts its causal buffer by ``T`` (``bias[:, :, :T, :T]``):
    on sequence shards that is T / tp rows of the mask beside whole-sequence scores. No view
    fix reaches it; sequence parallel is dropped and the warning names the block and file."""
    plan = _plan(natural.inline_mask, 2, seq=2048)
    styles = _block_styles(plan, "blocks.0.")
    assert {k: styles[k] for k in SPLIT_BY_HEADS} == SPLIT_BY_HEADS, plan.warnings
    assert "sequence_parallel" not in plan.module_styles().values()
    assert [w.split(":")[0] for w in plan.warnings] == ["blocks.0"], plan.warnings
    assert "sequence parallel off" in plan.warnings[0] and "natural.py" in plan.warnings[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_module_reading_its_width_is_split_by_heads(tp: int) -> None:
    plan = _plan(natural.split_attention, tp)
    styles = _block_styles(plan, "blocks.0.")
    assert (styles["attn.qkv"], styles["attn.o"], styles["mlp.0"], styles["mlp.2"]) == (
        "packed_colwise", "rowwise", "colwise", "rowwise"), plan.warnings
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("spec", ["tests.portability.natural:inline", "tests.portability.natural:split_attention",
                                  "tests.portability.natural:mqa"])
def test_natural_styles_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, timeout_s=300)
    styles = _block_styles(result.plan, "blocks.0.")
    attention = {k: v for k, v in styles.items() if k.split(".")[-1] in ("qkv", "q", "proj", "o")}
    assert set(attention.values()) in ({"packed_colwise", "rowwise"}, {"colwise", "rowwise"}), styles
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("builder", "attn", "q", "kv", "o"), [
    (natural.mqa, "blocks.0.attn.", "q", ("kv",), "o"),
    (natural.hf_llama_mqa, "model.layers.0.self_attn.", "q_proj", ("k_proj", "v_proj"), "o_proj"),
])
def test_one_kv_head_keeps_the_query_heads_split(builder, attn: str, q: str, kv: tuple, o: str, tp: int) -> None:
    """MQA: q split by heads, o rowwise, the one k/v head whole on every rank (gathered from
    rows split tp ways, its gradient summed by the gather's reduce-scatter), as Megatron."""
    plan = _plan(builder, tp)
    styles = _block_styles(plan, attn)
    assert (styles[q], styles[o]) == ("colwise", "rowwise"), plan.warnings
    assert {styles[k] for k in kv} == {"colwise_gather_output"}, styles
    assert all("one kv head" in w for w in plan.warnings), plan.warnings


@pytest.mark.parametrize("builder", [natural.inline, natural.mqa, natural.hf_llama_mqa])
def test_natural_styles_collectives_equal_the_prediction(builder) -> None:
    plan = _plan(builder, 2)
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    for phase in ("forward", "backward"):
        assert result.counted_bytes[phase] == plan.estimate.collective_bytes[phase], phase


def test_one_kv_head_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.natural:hf_llama_mqa", nproc=2, timeout_s=300)
    assert result.plan.rule_for("model.layers.0.self_attn.q_proj").style == "colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_gpt2_fused_conv1d_is_split_by_heads(tp: int) -> None:
    """GPT-2's c_attn is HF's Conv1D ([in, out]) cut by ``split(self.split_size, dim=2)``:
    packed along weight dim 1, the split size made local."""
    plan = _plan(natural.hf_gpt2_odd_vocab, tp)
    styles = _block_styles(plan, "transformer.h.0.")
    assert (styles["attn.c_attn"], styles["attn.c_proj"], styles["mlp.c_fc"], styles["mlp.c_proj"]) == (
        "packed_colwise", "rowwise", "colwise", "rowwise"), plan.warnings
    assert plan.rule_for("transformer.h.0.attn.c_attn").packed == 3
    assert [(a.module, a.values) for a in plan.attributes] == [("transformer.h.*.attn", {"split_size": 64 // tp})]


def test_hf_gpt2_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.natural:hf_gpt2_odd_vocab", nproc=2, timeout_s=300)
    assert result.plan.rule_for("transformer.h.0.attn.c_attn").style == "packed_colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


HF_DECODERS = [natural.hf_llama_mqa, natural.hf_gpt2_odd_vocab]


def _sp_plan(builder, tp: int, **options) -> Plan:
    return shardplan.plan_model(builder(), {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long),),
                                explain=False, **options)


@pytest.mark.parametrize("builder", HF_DECODERS)
@pytest.mark.parametrize("tp", [2, 4])
def test_hf_decoders_take_sequence_parallel_with_the_embedding_handed_on_as_a_dtensor(builder, tp: int) -> None:
    """Hugging Face's decoders make positions and the mask from the embedding's output
    (``arange(inputs_embeds.shape[1])``), and GPT-2 views its final norm's output by the
    input's length: on local sequence shards both read s / tp. The check of the code between
    the blocks finds it; the embeddings (and GPT-2's final norm) then hand their sequence
    shards on as DTensors, whose sizes are global, and the first block takes its local part."""
    plan = _sp_plan(builder, tp, sequence_parallel=True)
    styles = plan.module_styles()
    norms = [m for m in styles if m.rpartition(".")[2] in ("input_layernorm", "post_attention_layernorm", "norm",
                                                           "ln_1", "ln_2", "ln_f")]
    assert norms and all(styles[m] == "sequence_parallel" for m in norms), {m: styles[m] for m in norms}
    handed = {(r.module, r.input): (r.input_layouts, r.desired_input_layouts, r.use_local_output)
              for r in plan.regions if "DTensor" in r.why}
    first = "model.layers.0" if any(m.startswith("model.") for m in styles) else "transformer.h.0"
    assert handed[(first, 0)] == ("Shard(1)", "Shard(1)", True), handed
    embeddings = [m for m, _ in handed if m.rpartition(".")[2] in ("embed_tokens", "wte", "wpe")]
    assert embeddings and all(handed[(m, "output")] == ("Shard(1)", "Shard(1)", False) for m in embeddings), handed
    assert all(h[0] == h[1] for h in handed.values()), "a handover moves no data"
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_code_between_blocks_reading_a_blocks_attributes_is_checked() -> None:
    """Granite's sliding-window decoder reads its layers' ``attention_type`` between them to
    pick each layer's RoPE table. The check's stand-ins had no such attribute, the code
    between the blocks went unchecked, and under sequence parallel the ranks got RoPE tables
    of half the sequence (``size of tensor a (128) must match ... (64)`` on the fake group).
    Stand-ins carry their block's plain attributes: the check finds the positions read off
    sequence shards and hands the embedding on as a DTensor."""
    from shardplan.tools.sources import resolve_model

    model, inputs, _ = resolve_model("hf-tiny:granite_swa", device="cpu")
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, explain=False, sequence_parallel=True)
    handed = [(r.module, r.input) for r in plan.regions if "DTensor" in r.why]
    assert ("model.embed_tokens", "output") in handed, plan.regions
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_views_a_library_helper_makes_are_not_counted_as_the_modules() -> None:
    """Dory's attention reads its length off its sequence-split input and views the gathered
    q/k/v by it; transformers' sdpa helper repeats the kv heads with reshapes on meta but not
    on CPU, so a fix named by its call landed on another view on the ranks (``size of tensor
    a (128) must match ... (64)``). Only the views the module's own file makes are counted."""
    from shardplan.tools.sources import resolve_model

    model, inputs, _ = resolve_model("hf-tiny:dory", device="cpu")
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, explain=False, sequence_parallel=True)
    assert any(f.seq_dim is not None for v in plan.local_views for f in v.fixes), plan.local_views
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_value_no_layer_reads_is_not_cut_for_nothing() -> None:
    """Qwen3-Next's small config has no full-attention layer, so nothing reads its RoPE
    tables; with no price on a cut, the program cut ``position_ids`` where the rotary module
    receives them (a tie), the tables came out half as long as the plan said, and
    ``sequence_parallel=True`` raised. A cut costs a hook: the tables stay whole."""
    from shardplan.tools.sources import resolve_model

    model, inputs, _ = resolve_model("hf-tiny:qwen3_next", device="cpu")
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, explain=False, sequence_parallel=True)
    assert not [r for r in plan.regions if r.module == "model.rotary_emb"], plan.regions
    assert plan.module_styles()["model.norm"] == "sequence_parallel", plan.warnings
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("spec", ["tests.portability.natural:hf_llama_mqa", "tests.portability.natural:hf_gpt2_odd_vocab",
                                  "hf-tiny:granite_swa"])
def test_hf_decoders_under_sequence_parallel_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert "sequence_parallel" in result.plan.module_styles().values(), result.plan.warnings


def test_sequence_parallel_left_to_the_planner_is_kept_on_hf_decoders() -> None:
    """At seq 2048 the cost model puts HF Llama's norms on sequence shards, and they stay there."""
    plan = _plan(natural.hf_llama_mqa, 2, seq=2048)
    assert plan.module_styles()["model.norm"] == "sequence_parallel", plan.warnings
    assert not [w for w in plan.warnings if "sequence parallel off" in w], plan.warnings


def test_code_between_blocks_that_takes_sequence_shards_keeps_them() -> None:
    """Positions made from the token ids' shape (whole) leave sequence parallel to the cost model."""
    plan = _plan(natural.split_attention, 2, seq=2048)
    assert plan.module_styles()["blocks.0.norm1"] == "sequence_parallel", plan.warnings
    result = simulate(natural.split_attention(), plan, (torch.randint(0, 256, (2, 2048)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("builder", [natural.rope_complex_lm, natural.rope_interleaved_lm, natural.rope_partial_lm,
                                     natural.mqa_repeat_interleave, natural.rope_complex_gqa, natural.rope_stack_as_lm])
def test_every_rope_spelling_keeps_heads_split(builder, tp: int) -> None:
    """RoPE as a complex product, rotate-half, interleaved pairs (flattened, or stacked and
    shaped back by ``reshape_as(q)``, RoFormer's) or on part of each head, its table made in
    forward; 4 kv heads, 2 (grouped at tp=4, also through view_as_complex) or 1 (MQA,
    repeated by repeat_interleave)."""
    plan = _plan(builder, tp)
    styles = _block_styles(plan, "blocks.0.attn.")
    kv = {"colwise"} if builder().blocks[0].attn.kv >= tp else (
        {"colwise_kv_gathered"} if builder().blocks[0].attn.kv > 1 else {"colwise_gather_output"})
    assert (styles["wq"], styles["wo"], {styles["wk"], styles["wv"]}) == ("colwise", "rowwise", kv), plan.warnings
    assert all("one kv head" in w for w in plan.warnings), plan.warnings


@pytest.mark.parametrize(("spec", "nproc"), [("tests.portability.natural:mqa_repeat_interleave", 2),
                                             ("tests.portability.natural:rope_complex_gqa", 4)])
def test_rope_and_kv_heads_match_one_process_on_gloo(spec: str, nproc: int) -> None:
    result = verify(spec, nproc=nproc, timeout_s=300)
    assert result.plan.rule_for("blocks.0.attn.wq").style == "colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_grouped_complex_rope_collectives_equal_the_prediction() -> None:
    plan = _plan(natural.rope_complex_gqa, 4)
    result = simulate(natural.rope_complex_gqa(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_fused_gqa_qkv_cut_into_unequal_parts_is_split_by_heads() -> None:
    """gpt-fast's ``wqkv(x).split([dim, kv_size, kv_size])`` (8 query heads, 2 kv heads): each
    rank holds its heads of every part, [q_r; k_r; v_r] (``packed: [4, 1, 1]``, a PackedShard
    whose global view is the module's own [Q; K; V]), and the split's widths are local."""
    plan = _plan(natural.fused_gqa, 2)
    wqkv = plan.rule_for("layers.0.wqkv")
    assert (wqkv.style, wqkv.packed, plan.module_styles()["layers.0.wo"]) == ("packed_colwise", [4, 1, 1], "rowwise")
    assert [a.values for a in plan.attributes] == [{"n_head": 4, "dim": 64, "n_local_heads": 1}]
    assert not plan.warnings, plan.warnings
    result = simulate(natural.fused_gqa(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    run = verify("tests.portability.natural:fused_gqa", nproc=2, timeout_s=300)
    assert run.passed and run.plan.rule_for("layers.0.wqkv").packed == [4, 1, 1], run.summary()


def _fused_six_heads() -> natural.FusedGQALM:
    model = natural.FusedGQALM(dim=96)
    model.layers = nn.ModuleList(natural.FusedGQAAttention(96, 6, 2) for _ in range(2))
    return model


def test_attention_run_whole_behind_rowwise_projections_is_said() -> None:
    """At tp=4 the 6 query heads cannot be split; the plan that shards the weights anyway
    (q/k/v rowwise after a feature-split embedding) runs attention whole on every rank,
    which the warnings must say, at the attention, with the split that blocks it."""
    plan = _plan(_fused_six_heads, 4)
    (said,) = [w for w in plan.warnings if "attention runs whole" in w]
    assert said.startswith("layers.*: attention runs whole on every rank: `scaled_dot_product_attention`")
    assert "layers.*.wqkv being " in said and "unequal parts [96, 32, 32]" in said, said
    assert "tp=4 divides the first part's (query) heads" in said, said


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("builder", [natural.cut_slice, natural.cut_narrow, natural.cut_unpack, natural.cut_unflatten])
def test_a_packed_qkv_cut_any_way_is_split_by_heads(builder, tp: int) -> None:
    """``qkv[..., :C]``, ``qkv.narrow(-1, C, C)`` (C read off the input: cut made local),
    ``q, k, v = qkv.reshape(B, T, 3, heads, C // heads).permute(...)``, ``chunk`` then
    ``unflatten``; the last two used to plan q/k/v rowwise behind a feature-split embedding,
    attention whole on every rank, priced a few microseconds faster at this size."""
    plan = _plan(builder, tp)
    styles = _block_styles(plan, "attn.0.")
    assert (styles["qkv"], styles["proj"]) == ("packed_colwise", "rowwise"), plan.warnings
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("spec", ["tests.portability.natural:cut_slice", "tests.portability.natural:cut_narrow"])
def test_packed_qkv_cuts_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, timeout_s=300)
    assert [v.cuts for v in result.plan.local_views] == [[CutFix(call=k, parts=2) for k in range(3)]]
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    # all but the proj biases: emb, head (weight, bias), and per layer the packed qkv's weight and
    # bias (a _StridedShard, whose is_shard() is False) and proj's weight
    assert (result.sharded_params, result.num_params) == (9, 11)


@pytest.mark.parametrize(("batch", "seq"), [(8, 16), (2, 8), (8, 8)])
@pytest.mark.parametrize("builder", [natural.rope_complex_lm, natural.mqa_repeat_interleave, natural.cut_unpack])
def test_a_head_count_equal_to_another_size_is_still_the_head_count(builder, batch: int, seq: int) -> None:
    """8 heads of 16: head_dim / 2 (the RoPE pairs) is 8 too, and so is the batch, the
    sequence or both here; the plan splits the heads, not the other 8s."""
    with torch.device("meta"):
        model = builder()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(torch.zeros(batch, seq, dtype=torch.long, device="meta"),),
                                explain=False)
    attention = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if ".0." in k and "attn" in k}
    assert attention.get("wo", attention.get("proj")) == "rowwise", (attention, plan.warnings)
    assert set(attention.values()) & {"colwise", "packed_colwise"}, attention


def test_sequence_parallel_asked_of_norms_over_all_heads_keeps_them_on_heads() -> None:
    """OLMo 2 normalizes q and k over all heads (``q_norm`` of ``[b, s, heads * hd]``): asked
    for sequence parallel, the residual stream's norms take it and q_norm/k_norm stay on the
    gathered projections, handing on each rank's heads, as without it."""
    result = verify("hf-tiny:olmo2", nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    styles = result.plan.module_styles()
    assert styles["model.layers.0.post_attention_layernorm"] == styles["model.norm"] == "sequence_parallel"
    assert styles["model.layers.0.self_attn.q_norm"] == "replicate"
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise", styles


@pytest.mark.parametrize("spec", ["hf-tiny:mixtral", "hf-tiny:qwen3_moe"])
def test_moe_decoders_under_sequence_parallel_match_one_process_on_gloo(spec: str) -> None:
    """A MoE block flattens the tokens to route them (``view(-1, hidden)``) and reshapes them
    back: it takes them gathered where it receives them and hands its experts' partial sums
    back reduce-scattered onto sequence shards where it returns (torchtitan's
    ``PrepareModuleInputOutput``): one all-gather and one reduce-scatter per MoE block."""
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    plan = result.plan
    assert plan.module_styles()["model.layers.0.mlp.experts"] in ("moe_tp_experts", "moe_whole_experts")
    assert plan.rule_for("model.layers.0.mlp.experts").output_layouts == "Partial"
    mlp = {r.input: (r.input_layouts, r.desired_input_layouts, r.use_local_output)
           for r in plan.regions if r.module == "model.layers.*.mlp"}
    assert mlp == {0: ("Shard(1)", "Replicate", True), "output": ("Partial", "Shard(1)", True)}, plan.regions


def test_moe_sequence_parallel_collectives_equal_the_prediction() -> None:
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model("mixtral", tiny=True, device="cpu")
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=inputs, sequence_parallel=True, explain=False)
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted["forward"]["reduce_scatter"] >= 2  # each layer's MoE block returns sequence shards


@pytest.mark.parametrize("nproc", [2])
def test_phi3_slices_of_unequal_parts_match_one_process_on_gloo(nproc: int) -> None:
    """Phi-3's q/k/v slices of a fused projection (4 query heads, 2 kv heads), packed by parts."""
    result = verify("hf-tiny:phi3", nproc=nproc, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert result.plan.rule_for("model.layers.0.self_attn.qkv_proj").packed == [2, 1, 1]


@pytest.mark.parametrize("spec", ["hf-tiny:deepseek_v3", "hf-tiny:gpt_oss", "hf-tiny:qwen2_moe"])
def test_moe_blocks_with_shared_experts_or_tuples_under_sequence_parallel_match_one_process_on_gloo(spec: str) -> None:
    """DeepSeek-V3's router is called on ``[b, s, h]`` and flattens the tokens itself, and its
    shared experts' ``down_proj`` leaves its partial sums unreduced, so that ``routed +
    shared`` is reduce-scattered once where the block returns; gpt-oss's block returns
    ``(hidden, router_scores)``, reduce-scattered at the element that is the partial sum;
    Qwen2-MoE scales its shared expert's output by a gate computed from the tokens: every
    weight sharded (the default), its 1-row gate Linear splits its input
    (``rowwise_split_input``), the gated sum is whole, and it is cut onto sequence shards
    where the block returns (before a whole value could not be cut inside a block, and the gate
    stayed whole, ``replicated_with_grad_allreduce``)."""
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    plan = result.plan
    styles = plan.module_styles()
    assert styles["model.norm"] == styles["model.layers.1.post_attention_layernorm"] == "sequence_parallel", styles
    exits = [r for r in plan.regions if r.input == "output" and r.input_layouts in ("Partial", "Replicate")
             and r.module.endswith("mlp")]
    assert exits and all(r.desired_input_layouts == "Shard(1)" for r in exits), plan.regions
    if spec.endswith("deepseek_v3"):
        down = plan.rule_for("model.layers.1.mlp.shared_experts.down_proj")
        assert (down.style, down.output_layouts, down.use_local_output) == ("rowwise", "Partial", None), down
        assert plan.rule_for("model.layers.1.self_attn.q_b_proj").style == "colwise", styles
    elif spec.endswith("gpt_oss"):
        assert [(r.output_index, r.num_outputs) for r in exits] == [(0, 2)], exits
    else:
        assert styles["model.layers.0.mlp.shared_expert_gate"] == "rowwise_split_input", styles
        assert [(r.input_layouts, r.desired_input_layouts) for r in exits] == [("Replicate", "Shard(1)")], exits


def test_moe_shared_experts_collectives_equal_the_prediction() -> None:
    from shardplan.interop.hf import build_hf_model

    model, inputs, _ = build_hf_model("deepseek_v3", tiny=True, device="cpu")
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=inputs, sequence_parallel=True, explain=False)
    result = simulate(model, plan, inputs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_gate_computed_from_the_tokens_scales_a_partial_sum_only_with_its_gradient_summed() -> None:
    """Qwen2-MoE's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``: with the shared
    expert's output a partial sum, the gate's gradient is one too. Every strategy of that
    ``mul`` reading the gated value ``P`` reads the gate ``Rp`` (whole, its gradient Partial),
    never plain ``R``, and the gate's Linear offers an ``Rp`` output whose gradient it sums."""
    from shardplan.analyze.frontend import op_graph
    from shardplan.decide.strategies import op_strategies
    from shardplan.interop.hf import build_hf_model

    model, inputs, kwargs = build_hf_model("qwen2_moe", tiny=True)
    graph = op_graph(model, inputs, kwargs)
    gated = [op for op in graph.ops if op.kind == "function" and op.target == "mul" and op.owner == "model.layers.0.mlp"
             and any(graph.ops[graph.values[v].producer].target == "model.layers.0.mlp.shared_expert.down_proj"
                     for v in op.inputs)]
    assert gated, "qwen2_moe's gated shared expert was not traced as a mul"
    for op in gated:
        partial = [s for s in op_strategies(op, graph, tp=2) if "P" in s.inputs]
        assert partial and all(p == "Rp" for s in partial for v, p in zip(op.inputs, s.inputs)
                               if p != "P" and v in graph.requires_grad), partial
    gate = next(op for op in graph.ops if op.target == "model.layers.0.mlp.shared_expert_gate")
    assert any(s.output == "Rp" and s.name == "replicated_with_grad_allreduce" for s in op_strategies(gate, graph, tp=2))


# Norms that no plan can put on sequence shards stay whole, named in a warning;
# sequence_parallel=True splits every other norm.
SP_KEPT_WHOLE = {
    "bitnet": ("attn_sub_norm", "ffn_sub_norm"),  # on the features between two projections
    "rwkv": ("pre_ln", "ln1", "ln2"),  # each feeds a token shift (ZeroPad2d), which needs whole sequences
    "bert": (),  # the LM head's dense -> gelu -> LayerNorm: gelu's whole output cut where it returns
    "modernbert-decoder": (),
    "biogpt": (),  # a learned position-embedding module called with the mask: kept whole, sliced
    "bart": (),
    "lfm3": (),  # its short-conv block runs whole (a conv weight read as a tensor), cut where it returns
    "afmoe": (),  # a norm reads the MoE block's partial sums, reduce-scattered where the block returns
    "mimo_v2_flash": (),  # its router, inside a MoE block that gathers the tokens, is checked on them whole
}


@pytest.mark.parametrize("model_type", sorted(SP_KEPT_WHOLE))
def test_sequence_parallel_true_splits_every_norm_it_can_and_names_the_rest(model_type: str) -> None:
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="cpu", seed=0)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs,
                                sequence_parallel=True, explain=False)
    called = set()  # BART's causal LM holds cross-attention norms it never calls
    hooks = [m.register_forward_hook(lambda mod, *_: called.add(mod)) for m in model.modules()]
    with torch.no_grad():
        model(*inputs, **kwargs)
    for h in hooks:
        h.remove()
    norms = {m: s for m, s in plan.module_styles().items()
             if type(mod := model.get_submodule(m)).__name__.endswith("Norm") and mod in called}
    whole = {re.sub(r"\.\d+\.", ".*.", m) for m, s in norms.items() if s == "replicate"}  # q/k norms on heads: their own style
    assert any(s == "sequence_parallel" for s in norms.values()), norms
    named = {re.sub(r"\.\d+\.", ".*.", w.split(":")[0]) for w in plan.warnings if "kept whole under sequence_parallel=True" in w}
    # a norm fed by another norm may hand on each rank's features (replicate to Shard(-1)), as
    # a norm over all heads does: kept whole but not off sequence shards by choice
    assert named <= whole, (named, whole)
    expected = SP_KEPT_WHOLE[model_type]
    assert {n for m in named for n in expected if m.endswith(n)} == set(expected), named
    assert all(m.endswith(expected) for m in named) if expected else not named, named


@pytest.mark.parametrize("spec", ["hf-tiny:bitnet", "hf-tiny:rwkv", "hf-tiny:bert", "hf-tiny:roformer"])
def test_sequence_parallel_with_norms_kept_whole_or_outputs_cut_matches_one_process_on_gloo(spec: str) -> None:
    """Norms kept whole (BitNet's on features, RWKV's before its token shift); an LM-head
    transform whose activation's whole output is cut onto sequence shards where it returns,
    for the norm after it (BERT); RoFormer, whose encoder makes its rotary table from the
    projected embedding's sequence length and whose head reads ``pad_token_id in input_ids``
    (an ``.item()`` meta cannot run): the code between the blocks is checked with that value
    read as 0, finds the length, and the projection hands its shards on as a DTensor.
    (BioGPT's sliced position module, LFM3's conv weight read as a tensor and AFMoE's norm
    after a MoE block plan in the test above and are counted by ``simulate`` below.)"""
    result = verify(spec, nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert "sequence_parallel" in result.plan.module_styles().values(), result.plan.warnings
    if spec.endswith("bitnet"):  # attn_sub_norm over all heads gathers its input; attention stays split
        styles = result.plan.module_styles()
        assert [styles[f"model.layers.0.self_attn.{m}_proj"] for m in "qkvo"] == ["colwise"] * 3 + ["rowwise"], styles
        gathered = {r.module for r in result.plan.regions if r.input == 0 and r.desired_input_layouts == "Replicate"
                    and r.input_layouts == "Shard(2)"}
        assert gathered == {"model.layers.*.self_attn.attn_sub_norm", "model.layers.*.mlp.ffn_sub_norm"}, result.plan.regions
    if spec.endswith("roformer"):
        assert not [w for w in result.plan.warnings if "not checked" in w], result.plan.warnings
        styles = result.plan.module_styles()  # its rotary: stack([-q[..., 1::2], q[..., ::2]]).reshape_as(q)
        assert {styles[f"roformer.encoder.layer.0.attention.self.{m}"] for m in ("query", "key", "value")} == {"colwise"}
        assert styles["roformer.encoder.layer.0.attention.output.dense"] == "rowwise", styles
        handed = [r for r in result.plan.regions if r.module == "roformer.embeddings_project"]
        assert [(r.input, r.use_local_output) for r in handed] == [("output", False)], result.plan.regions
    if spec.endswith("bert"):
        cuts = [r for r in result.plan.regions if r.input == "output" and r.input_layouts == "Replicate"]
        assert [(r.module, r.desired_input_layouts) for r in cuts] == [
            ("cls.predictions.transform.transform_act_fn", "Shard(1)")], cuts


@pytest.mark.parametrize("tp", [2, 4])
def test_a_norm_over_all_heads_after_attention_gathers_its_input_and_attention_stays_split(tp: int) -> None:
    """BitNet normalizes the attention's output over all heads (``attn_sub_norm``) before
    ``o_proj``, and the MLP's product before ``down_proj``: each sub-norm gathers its input
    where it receives it and hands on each rank's features, so q/k/v stay colwise and the
    attention split by heads (it ran whole behind gathered q/k/v before)."""
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model("bitnet", tiny=True)
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    styles = plan.module_styles()
    q, k, v, o = (styles[f"model.layers.0.self_attn.{m}_proj"] for m in "qkvo")
    # 2 kv heads: at tp=4 each is held by the 2 ranks whose query heads read it
    assert (q, o) == ("colwise", "rowwise") and {k, v} <= {"colwise", "colwise_kv_gathered"}, plan.warnings
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise", styles
    assert plan.rule_for("model.layers.0.self_attn.attn_sub_norm").output_layouts == "Shard(2)"


def test_a_parameter_free_module_that_moves_tokens_is_not_taken_for_elementwise() -> None:
    """RWKV's token shift, ``nn.ZeroPad2d((0, 0, 1, -1))``, keeps its input's shape but moves
    each token to the next position: on sequence shards each rank would lose a token at its
    boundary. Only activation and dropout modules are elementwise by their class; DTensor's
    propagation answers for the others (the shift takes its sequence whole)."""
    from torch import nn

    from shardplan.analyze.frontend import op_graph
    from shardplan.decide.strategies import op_strategies

    class TokenShift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.norm, self.out = nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64)
            self.shift, self.act = nn.ZeroPad2d((0, 0, 1, -1)), nn.GELU()

        def forward(self, ids):
            x = self.norm(self.emb(ids))
            return self.out(self.act(x) + self.shift(x))

    graph = op_graph(TokenShift(), (torch.zeros(2, 16, dtype=torch.long),), {})
    shift, act = (next(op for op in graph.ops if op.node.target == name) for name in ("shift", "act"))
    assert "S1" not in {s.inputs[0] for s in op_strategies(shift, graph, tp=2)}
    assert "S1" in {s.inputs[0] for s in op_strategies(act, graph, tp=2)}


@pytest.mark.parametrize("model_type", ["bert", "rwkv", "afmoe", "lfm3", "biogpt", "bitnet"])
def test_sequence_parallel_cuts_and_kept_norms_collectives_equal_the_prediction(model_type: str) -> None:
    """A whole output cut where its module returns costs no forward collective and one
    all-gather of its gradient; the count on the fake group (tp=4) equals the estimate's."""
    from shardplan.interop.hf_models import build_hf_model, positional

    model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="cpu", seed=0)
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=inputs, example_kwargs=kwargs,
                                sequence_parallel=True, explain=False)
    result = simulate(model, plan, positional(model, inputs, kwargs))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("batch", [2, 3, 4])
def test_alibi_folded_into_the_batch_keeps_attention_split_by_heads(tp: int, batch: int) -> None:
    """Megatron-DeepSpeed's and Bloom's ALiBi: the root makes ``[b * heads, 1, keys]`` once and
    every attention adds it to scores folded the same way (``alibi.baddbmm(q, k)``). Each
    rank cuts its heads of every batch row where the attention receives it (Replicate ->
    Shard(0) in runs of the head count), so q/k/v stay colwise; before, q/k/v were gathered
    and attention ran whole. The run is the head count whatever the batch (4 heads: batch 4
    equals it)."""
    with torch.device("meta"):
        model = natural.folded_alibi()
    tokens = torch.zeros(batch, 16, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)
    styles = _block_styles(plan, "blocks.0.attn.")
    assert [styles[m] for m in "qkvo"] == ["colwise"] * 3 + ["rowwise"], plan.warnings
    folds = [(r.module, r.input, r.input_layouts, r.desired_input_layouts, r.fold) for r in plan.regions if r.fold]
    assert folds == [("blocks.*.attn", 1, "Replicate", "Shard(0)", model.heads)], plan.regions
    assert not plan.warnings, plan.warnings


def test_alibi_folded_into_the_batch_matches_one_process_on_gloo_at_another_batch() -> None:
    """Planned at batch 2, run at batch 3: the cut follows the batch the ranks see."""
    with torch.device("meta"):
        model = natural.folded_alibi()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(tokens,), explain=False)
    result = verify("tests.portability.natural:folded_alibi", plan=plan, nproc=2, batch_size=3, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("nproc", [2, 4])
def test_bloom_attention_is_split_by_heads_and_matches_one_process_on_gloo(nproc: int) -> None:
    """Bloom's fused q/k/v (``[heads, 3, head_dim]`` rows) colwise and its dense rowwise beside
    the folded ALiBi, sequence parallel on: 4 heads over 2 and 4 ranks."""
    result = verify("hf-tiny:bloom", nproc=nproc, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    styles = result.plan.module_styles()
    attn = "transformer.h.0.self_attention"
    assert (styles[f"{attn}.query_key_value"], styles[f"{attn}.dense"]) == ("colwise", "rowwise"), result.plan.warnings
    assert [r.fold for r in result.plan.regions if r.fold] == [4], result.plan.regions


def _norm_pins() -> dict[str, str]:
    return {"attn.*.q_norm": "norm_sharded", "attn.*.k_norm": "norm_sharded"}


@pytest.mark.parametrize("norm", [natural.HandRMSNorm, natural.torch_rms_norm])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_norm_over_all_heads_runs_on_the_heads_split_with_its_statistic_all_reduced(tp: int, norm) -> None:
    """OLMo 2 normalizes q and k over all heads (``q_norm`` of ``[b, s, heads * hd]``). At a
    real width the planner keeps q/k colwise and runs the norm on the split features
    (``norm_sharded``: DTensor all-reduces the statistic, one value per row) instead of
    gathering q and k for it, as Hugging Face's plan and vLLM do; the norm's weight is split
    with the features. Torch's fused ``nn.RMSNorm`` as well: the style runs it written out."""
    with torch.device("meta"):
        model = natural.QKNormLM(norm, dim=2048, heads=16)
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)
    styles = _block_styles(plan, "attn.0.")
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                      "q_norm": "norm_sharded", "k_norm": "norm_sharded"}, plan.warnings


def test_a_norm_over_all_heads_on_split_features_matches_one_process_and_its_collectives() -> None:
    from shardplan.interop.hf import build_hf_model

    model = natural.qk_rms_norm()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = shardplan.price_styles(model, {"tp": 2}, _norm_pins(), example_inputs=(tokens,))
    assert _block_styles(plan, "attn.0.")["q_proj"] == "colwise" and not plan.warnings, plan.warnings
    result = verify("tests.portability.natural:qk_rms_norm", plan=plan, nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    counted = simulate(model, plan, (tokens,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
    # with FSDP over dp: the norm's Shard(0) weight is sharded again over dp, as a colwise bias is
    tokens4 = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    fresh = natural.qk_rms_norm()  # simulate applied the plan to ``model``
    both = shardplan.price_styles(fresh, {"dp": 2, "tp": 2}, _norm_pins(), example_inputs=(tokens4,), data_parallel="fsdp")
    assert both.module_styles()["attn.0.q_norm"] == "norm_sharded"
    counted = simulate(fresh, both, (tokens4,), fsdp=True)
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
    hf, inputs, kwargs = build_hf_model("olmo2", tiny=True, device="cpu")
    pins = {f"model.layers.*.self_attn.{n}": "norm_sharded" for n in ("q_norm", "k_norm")}
    olmo = shardplan.price_styles(hf, {"tp": 2}, pins, example_inputs=inputs, example_kwargs=kwargs)
    assert simulate(hf, olmo, inputs, kwargs).matches
    with pytest.raises(ValueError, match=r"q_norm: style 'norm_sharded' has no Hugging Face tp_plan counterpart"):
        olmo.to_hf_tp_plan(hf)


def test_torch_rms_norm_over_all_heads_on_split_features_matches_one_process_and_its_collectives() -> None:
    """``nn.RMSNorm`` calls one fused kernel, which DTensor runs on whole features; written out
    by the style, its statistic is one all-reduce, as counted and as predicted."""
    model = natural.qk_torch_rms_norm()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = shardplan.price_styles(model, {"tp": 2}, _norm_pins(), example_inputs=(tokens,))
    assert _block_styles(plan, "attn.0.")["q_norm"] == "norm_sharded" and not plan.warnings, plan.warnings
    result = verify("tests.portability.natural:qk_torch_rms_norm", plan=plan, nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    counted = simulate(model, plan, (tokens,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_a_norm_whose_code_gathers_split_features_is_kept_whole() -> None:
    """A LayerNorm written with ``var``: DTensor gathers the features for it, so on split
    features it would cost an all-gather, not the all-reduce it was priced at; the local
    check counts its collectives and the planner keeps it whole, saying why."""
    with torch.device("meta"):
        model = natural.qk_layer_norm()
    tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
    plan = shardplan.price_styles(model, {"tp": 2}, _norm_pins(), example_inputs=(tokens,))
    assert _block_styles(plan, "attn.0.")["q_norm"] == "replicate"
    assert any(w.startswith("attn.0.q_norm: replicated: its code on features split tp ways makes") and
               "all_gather" in w for w in plan.warnings), plan.warnings


def test_sequence_parallel_at_a_length_tp_does_not_divide_says_so() -> None:
    """A ViT's 16 patches and a class token make 17 positions: no norm can be on sequence
    shards at tp=2, and the refusal says the length is why, not a value of the code."""
    with torch.device("meta"):
        model = natural.split_attention()
    tokens = torch.zeros(2, 17, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"their sequence of 17 tokens, \[2, 17, 128\], does not split 2 ways"):
        shardplan.plan_model(model, {"tp": 2}, example_inputs=(tokens,), sequence_parallel=True)
