"""Folded blocks that return more than their hidden state, and inputs passed as None.

T5's first block computes a relative position bias per head and hands it, beside the hidden
state, to every later block. Folded blocks read what their representative reads, so the
bias a folded copy returns (``out[1]``) is the representative's, split by heads: before,
it stood for the hidden state and every attention Linear of the folded blocks was gathered
(``plan hf:t5 --mesh tp=8``: 22 outputs all-gathered and 21.7 ms predicted per step before,
6 and 14.4 ms after).
A ``None`` passed positionally (``forward(ids, None, decoder_ids)``, what the CLI gives an
encoder-decoder) is traced as the constant it is: a placeholder made ``if mask is None``
false and the fx trace failed (``hf:longt5`` planned with neither front end).

T5's cross-attention has no bias table: its first one adds ``torch.zeros(1, self.n_heads, q, k)``
to scores split by heads. A constant made from sizes alone may be split (each rank's piece
of it is the constant at the local size) when the code sizes it locally; the local check,
which now also runs the blocks of a kind of their own beside folded ones (T5's first) and
compares each such constant's shape with the plan's (broadcasting hid a global head count,
and meta's attention does not check its mask), finds ``n_heads`` the local value. Before,
the 6 cross-attentions of ``hf:t5`` were gathered; now 0 are, 11.6 ms predicted."""

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
    attentions = [f"{side}.block.{i}.layer.0.SelfAttention" for side in ("encoder", "decoder") for i in range(4)]
    for attention in attentions + [f"decoder.block.{i}.layer.1.EncDecAttention" for i in range(4)]:
        got = {n: styles[f"{attention}.{n}"] for n in "qkvo"}
        assert got == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, (attention, got)
    assert styles["encoder.block.0.layer.0.SelfAttention.relative_attention_bias"] == "colwise"
    # the first cross-attention builds its bias as torch.zeros(1, self.n_heads, q, k): split by
    # heads, which the local check (run on the first block too: no folded block covers it) sizes
    assert [(a.module, a.values) for a in plan.attributes] == [("decoder.block.0.layer.1.EncDecAttention", {"n_heads": 2})]


@pytest.mark.parametrize("builder", ["shared_bias_lm_with_inputs", "t5_four_layers"])
def test_folded_blocks_with_tuple_outputs_match_one_process_on_gloo(builder: str) -> None:
    result = verify(f"tests.portability.block_outputs:{builder}", nproc=2)
    assert result.passed, result.summary()
    assert result.sharded_params > result.num_params // 2, (result.sharded_params, result.num_params)


def test_a_state_made_of_zeros_is_split_by_heads_and_sized_locally() -> None:
    from tests.portability import constants

    with torch.device("meta"):
        model = constants.Model()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(TOKENS[0],), explain=False)
    styles = plan.module_styles()
    assert {styles[f"layers.{i}.{n}"] for i in range(3) for n in "qkv"} == {"colwise"}, styles
    assert {styles[f"layers.{i}.o"] for i in range(3)} == {"rowwise"}, styles
    assert [(a.module, a.values) for a in plan.attributes] == [("layers.*", {"num_heads": 2})]
    result = verify("tests.portability.constants:linear_attention_lm", nproc=2)
    assert result.passed, result.summary()
