"""An encoder-decoder Transformer written from scratch (``tests/portability/encoder_decoder.py``):
self- and cross-attention split by heads, and sequence parallel when asked, through the
post-LN layers, the dropouts around each sublayer and the position table before the blocks."""

from __future__ import annotations

import re

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability.encoder_decoder import encoder_decoder

SPEC = "tests.portability.encoder_decoder:encoder_decoder"


def _plan(tp: int, **options) -> shardplan.Plan:
    with torch.device("meta"):
        model = encoder_decoder()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 32, dtype=torch.long, device="meta"),),
                                explain=False, **options)


@pytest.mark.parametrize("tp", [2, 4])
def test_self_and_cross_attention_split_by_heads_and_every_norm_on_sequence_shards(tp: int) -> None:
    plan = _plan(tp, sequence_parallel=True)
    styles = {re.sub(r"\.\d+\.", ".*.", m): s for m, s in plan.module_styles().items()}
    for attn in ("encoder.layers.*.self_attn", "decoder.layers.*.self_attn", "decoder.layers.*.cross_attn"):
        assert [styles[f"{attn}.W_{w}"] for w in "qkvo"] == ["colwise"] * 3 + ["rowwise"], (attn, styles)
    norms = {m: s for m, s in styles.items() if ".norm" in m}
    assert len(norms) == 5 and set(norms.values()) == {"sequence_parallel"}, norms
    result = simulate(encoder_decoder(), plan, (torch.randint(2, 256, (2, 32)),))
    assert result.matches and result.counted_bytes == plan.estimate.collective_bytes, (
        dict(result.counted), result.predicted)


@pytest.mark.parametrize("sequence_parallel", [None, True])
def test_the_encoder_decoder_matches_one_process_on_gloo(sequence_parallel) -> None:
    result = verify(SPEC, nproc=2, seq_len=32, timeout_s=300, sequence_parallel=sequence_parallel)
    assert result.plan.module_styles()["decoder.layers.0.cross_attn.W_o"] == "rowwise", result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
