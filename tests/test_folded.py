"""Heads folded into the batch for ``torch.bmm`` (fairseq, OPT's and BLOOM's early code,
Megatron's legacy core attention): the folded placement ``S{d}p{k}`` through the view that
folds, the batched matmuls and softmax, and the view back; plans on meta at tp=2 and 4 (and
with sequence parallel), numerics on 2 gloo ranks against one process."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.decide.folded import folded_view
from shardplan.tools.verify import verify
from tests.portability import folded


def _tokens(seq: int = 16) -> tuple[torch.Tensor]:
    return (torch.zeros(2, seq, dtype=torch.long, device="meta"),)


@pytest.mark.parametrize(("src", "dst", "d", "parts", "want"), [
    ((2, 8, 5, 4), (16, 5, 4), 1, 1, "S0p2"),  # [b, h, s, d] split by heads -> [b * h, s, d]: b blocks
    ((16, 5, 4), (2, 8, 5, 4), 0, 2, "S1"),  # and back: the blocks are the batch, the split the heads
    ((5, 2, 32), (5, 8, 8), 2, 1, "S1p2"),  # fairseq: [t, b, h * d] -> [t, b * h, d]
    ((2, 8, 5, 4), (2, 8, 20), 1, 1, "S1"),  # heads untouched: a plain view (the view rule's own)
    ((2, 6, 5, 4), (12, 5, 4), 1, 1, None),  # 6 heads at tp=4: no rank holds whole heads
    ((16, 5, 4), (4, 4, 5, 4), 0, 2, "S0p2"),  # 2 blocks of 8 rows split in 2 are rows {0, 2} of 4 blocks of 4
    ((16, 5, 4), (2, 2, 4, 5, 4), 0, 2, "S1"),  # rank 0's rows {0-3, 8-11} are [:, 0] of [2, 2, 4]
    ((2, 8, 5, 4), (2, 4, 2, 5, 4), 1, 1, "S1"),  # 8 heads as 4 pairs: rank 0 holds pairs 0-1
])
def test_folded_view_places_the_blocks(src, dst, d, parts, want) -> None:
    tp = 4 if src[1] == 6 else 2
    assert folded_view(src, dst, d, parts, tp) == want


LOCAL = {"bmm_model": lambda tp: {"num_heads": 4 // tp, "embed_dim": 64 // tp},
         "megatron_model": lambda tp: {"num_attention_heads": 4 // tp, "hidden_size": 64 // tp},
         "expanded_mask_model": lambda tp: {"n_heads": 4 // tp},
         # fairseq's ``view(-1, bsz * self.num_heads, head_dim)``: the split dim is b * heads
         "fairseq_model": lambda tp: {"embed_dim": 64 // tp, "num_heads": 4 // tp}}
SPLIT = {"bmm_model": ("q_proj", "k_proj", "v_proj", "out_proj"), "megatron_model": ("query_key_value", "dense"),
         "expanded_mask_model": ("query_key_value", "dense"), "fairseq_model": ("q_proj", "k_proj", "v_proj", "out_proj")}


@pytest.mark.parametrize(("tp", "seq"), [(2, 16), (4, 16), (2, 2048)])
@pytest.mark.parametrize("name", sorted(LOCAL))
def test_folded_attention_is_split_by_heads(name: str, tp: int, seq: int) -> None:
    """Before folds were placed, every Linear of these attentions was gathered; at 2048
    tokens the plan is sequence parallel, and a fairseq attention, which reads its sequence
    length from its input, gets that input gathered where it receives it."""
    with torch.device("meta"):
        model = getattr(folded, name)()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=_tokens(seq), explain=False)
    styles = plan.module_styles()
    *cols, row = SPLIT[name]
    assert {styles[f"layers.{i}.attn.{n}"] for i in (0, 1) for n in cols} == {"colwise"}, styles
    assert {styles[f"layers.{i}.attn.{row}"] for i in (0, 1)} == {"rowwise"}, styles
    assert [(a.module, a.values) for a in plan.attributes] == [("layers.*.attn", LOCAL[name](tp))]
    assert not plan.warnings, plan.warnings
    if seq > 16 and name == "bmm_model":
        assert styles["layers.0.norm1"] == "sequence_parallel"
        assert [(r.module, r.input_layouts) for r in plan.regions] == [("layers.*.attn", "Shard(1)")]


@pytest.mark.parametrize("name", sorted(LOCAL))
def test_folded_attention_matches_one_process_on_gloo(name: str) -> None:
    result = verify(f"tests.portability.folded:{name}", nproc=2, timeout_s=300)
    assert "rowwise" in result.plan.module_styles().values()
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_time_major_fairseq_decoder_is_split_by_heads_and_counted() -> None:
    """fairseq's own layer: ``self_attn(query=h, key=h, value=h)`` on ``[t, b, c]`` and a
    softmax in float cast back by ``type_as``. The cast had no folded twin, so every
    projection was gathered (q/k/v ``colwise_gather_output``) with the batch split instead
    of the heads; and the region on ``query`` converted that slot only, so k_proj and v_proj
    each all-reduced their input's gradient as well (13 counted, 7 predicted at tp=4)."""
    from shardplan.tools.simulate import simulate

    model = folded.fairseq_decoder()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=_tokens(), explain=False)
    styles = plan.module_styles()
    assert [styles[f"layers.1.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj", "out_proj")] == \
        ["colwise", "colwise", "colwise", "rowwise"], plan.warnings
    result = simulate(folded.fairseq_decoder(), plan, _tokens())
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    checked = verify("tests.portability.folded:fairseq_decoder", nproc=2, timeout_s=300)
    assert checked.passed, checked.summary() + "\n" + "\n".join(checked.problems)


def test_sequence_parallel_asked_of_a_time_major_model_says_why_not() -> None:
    """Sequence parallel splits dim 1 of ``[batch, seq, hidden]``; fairseq's layers run on
    ``[seq, batch, hidden]``, so the refusal said "their sequence of 2 tokens" of a batch of
    2: it now names the layout."""
    with pytest.raises(shardplan.PlanningError, match=r"sequence of 2 tokens, \[16, 2, 64\].*runs sequence-first, "
                                                     r"its sequence is dim 0 \(16\)"):
        shardplan.plan_model(folded.fairseq_decoder(), {"tp": 4}, example_inputs=_tokens(), explain=False,
                             sequence_parallel=True)
