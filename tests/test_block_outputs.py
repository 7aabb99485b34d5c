"""Folded blocks that return more than their hidden state, and inputs passed as None.

T5's first block computes a relative position bias per head and hands it, beside the hidden
state, to every later block. Folded blocks read what their representative reads, so the
bias a folded copy returns (``out[1]``) is the representative's, split by heads: before,
it stood for the hidden state and every attention Linear of the folded blocks was gathered
(``plan hf:t5 --mesh tp=8``: 22 outputs all-gathered and 21.7 ms predicted per step before,
6 and 14.4 ms after; the 6 are the decoder's cross-attention, whose bias is built whole).
A ``None`` passed positionally (``forward(ids, None, decoder_ids)``, what the CLI gives an
encoder-decoder) is traced as the constant it is: a placeholder made ``if mask is None``
false and the fx trace failed (``hf:longt5`` planned with neither front end)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability import block_outputs

pytest.importorskip("transformers")

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"), None, torch.ones((), device="meta"))


def _attention_styles(plan: shardplan.Plan, part: str) -> set[tuple[str, str]]:
    return {(fqn.rsplit(".", 1)[1], style) for fqn, style in plan.module_styles().items() if part in fqn}


@pytest.mark.parametrize("fold", [True, False])
def test_a_bias_handed_from_block_to_block_stays_split_by_heads(fold: bool) -> None:
    with torch.device("meta"):
        model = block_outputs.SharedBiasLM()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS, explain=False, fold_repeated=fold)
    assert _attention_styles(plan, ".attn.") == {("0", "colwise"), ("1", "colwise"), ("2", "colwise"),
                                                  ("bias", "colwise"), ("out", "rowwise")}
    assert not plan.warnings, plan.warnings
    if fold:
        assert any(r.module.startswith("blocks.{1-3}.") for r in plan.rules), [r.module for r in plan.rules]


def test_t5s_folded_blocks_split_their_self_attention_by_heads() -> None:
    model, (ids, _, decoder_ids) = block_outputs.t5_four_layers()
    plan = shardplan.plan_model(model.to("meta"), {"tp": 2}, example_inputs=(ids.to("meta"),),
                                example_kwargs={"decoder_input_ids": decoder_ids.to("meta")}, explain=False)
    assert any(".block.{1-3}." in r.module for r in plan.rules), "the fx front end folds the blocks"
    styles = plan.module_styles()
    for side in ("encoder", "decoder"):
        for i in range(4):
            got = {n: styles[f"{side}.block.{i}.layer.0.SelfAttention.{n}"] for n in "qkvo"}
            assert got == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, (side, i, got)
    assert styles["encoder.block.0.layer.0.SelfAttention.relative_attention_bias"] == "colwise"


@pytest.mark.parametrize("builder", ["shared_bias_lm_with_inputs", "t5_four_layers"])
def test_folded_blocks_with_tuple_outputs_match_one_process_on_gloo(builder: str) -> None:
    result = verify(f"tests.portability.block_outputs:{builder}", nproc=2)
    assert result.passed, result.summary()
    assert result.sharded_params > result.num_params // 2, (result.sharded_params, result.num_params)
