"""A layer the forward calls more than once (ALBERT shares one layer across every position):
the check runs its first call, so only that call's views are expected of it. Before, every
call's views were expected of the one run, the check failed, and the attention ran whole."""

from __future__ import annotations

import shardplan
from shardplan.interop import hf
from shardplan.tools.verify import verify


def test_a_layer_called_at_every_position_keeps_its_attention_split_by_heads() -> None:
    model, inputs, kwargs = hf.build_hf_model("albert", tiny=True, device="meta")
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    attn = "encoder.albert_layer_groups.0.albert_layers.0.attention"
    styles = plan.module_styles()
    assert [styles[f"{attn}.{n}"] for n in ("query", "key", "value", "dense")] == ["colwise"] * 3 + ["rowwise"], \
        plan.warnings
    assert not [w for w in plan.warnings if "whole activations" in w], plan.warnings


def test_a_layer_called_at_every_position_matches_one_process_on_gloo() -> None:
    result = verify("hf-tiny:albert", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
