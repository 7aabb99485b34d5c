"""Attention that reads a split tensor for its dtype or device only (``q.new_full``,
``x.type_as(q)``, ``mask.to(q)``): the read moves no data, so q stays split by heads and the
mask or scalar made from it stays whole. Before, each such read tied the two tensors'
placements (and a mask made by ``q.new_full`` was taken to need a gradient), so the whole
attention ran gathered. Models in ``tests/portability/metadata_reads.py``."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import metadata_reads as models

BUILDERS = [models.diff_attention, models.attention_sinks]
OUTPUT = {"diff_attention": "out_proj", "attention_sinks": "o_proj"}


def _plan(builder, tp: int):
    with torch.device("meta"):
        model = builder()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_a_mask_or_scalar_made_from_q_keeps_attention_split_by_heads(builder, tp: int) -> None:
    plan = _plan(builder, tp)
    styles = {k.removeprefix("blocks.0.attn."): v for k, v in plan.module_styles().items() if k.startswith("blocks.0.attn.")}
    assert [styles[p] for p in ("q_proj", "k_proj", "v_proj", OUTPUT[builder.__name__])] == \
        ["colwise", "colwise", "colwise", "rowwise"], (styles, plan.warnings)
    assert not [w for w in plan.warnings if "all-gathered" in w or "whole" in w], plan.warnings


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_they_match_one_process_on_gloo(builder) -> None:
    result = verify(f"tests.portability.metadata_reads:{builder.__name__}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_sink_attention_collectives_equal_the_prediction() -> None:
    plan = _plan(models.attention_sinks, 4)
    result = simulate(models.attention_sinks(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
