"""Sequence parallel where the code flattens its tokens before the MLP (OPT's decoder layer).

``hidden.reshape(-1, h)`` of a sequence-split ``[b, s, h]`` is ``S0p{b}`` of ``[b * s, h]``
(each rank its slice of every sequence, :mod:`shardplan.decide.folded`). The norm after it
runs per token (``sequence_parallel`` on dim 0), fc1 all-gathers the tokens where it
receives them (rows in rank order), fc2 reduce-scatters its output in that order, so each
rank gets its own tokens back and the view to ``[b, s, h]`` is ``Shard(1)`` again. Checked:
the plan (Hugging Face's OPT and a user's block), one process against 2 and 4 gloo ranks
(also at a batch other than the planned one), and the predicted collectives against the
fake group's count.
"""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.model import Plan
from shardplan.tools.simulate import simulate
from shardplan.tools.sources import resolve_model
from shardplan.tools.verify import verify
from tests.portability import natural

OPT = "model.decoder.layers.0."


def _plan(model, tp: int, batch: int = 2) -> Plan:
    tokens = torch.zeros(batch, 16, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False, sequence_parallel=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_opt_plans_sequence_parallel_through_its_flattened_mlp(tp: int) -> None:
    plan = _plan(resolve_model("hf-tiny:opt")[0], tp)
    norm, fc1, fc2 = (plan.rule_for(OPT + m) for m in ("final_layer_norm", "fc1", "fc2"))
    assert (norm.style, norm.input_layouts) == ("sequence_parallel", "Shard(0)"), plan.warnings
    assert (fc1.style, fc1.input_layouts, fc2.style, fc2.output_layouts) == ("colwise", "Shard(0)", "rowwise", "Shard(0)")
    assert plan.rule_for(OPT + "self_attn_layer_norm").style == "sequence_parallel"
    assert not [w for w in plan.warnings if "layer_norm" in w], plan.warnings


def test_a_users_block_flattening_its_tokens_plans_sequence_parallel() -> None:
    with torch.device("meta"):
        model = natural.flat_mlp()
    plan = _plan(model, 2)
    styles = {k: v for k, v in plan.module_styles().items() if k.startswith("blocks.0.")}
    assert styles == {"blocks.0.ln_1": "sequence_parallel", "blocks.0.attn.qkv": "packed_colwise", "blocks.0.attn.o": "rowwise",
                      "blocks.0.ln_2": "sequence_parallel", "blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise"}, plan.warnings


@pytest.mark.parametrize(("spec", "nproc", "batch"), [("hf-tiny:opt", 2, 2), ("hf-tiny:opt", 4, 2),
                                                      ("tests.portability.natural:flat_mlp", 2, 3)])
def test_flattened_tokens_match_one_process_on_gloo(spec: str, nproc: int, batch: int) -> None:
    """Planned at batch 2; the user's block run at batch 3: the rank order follows the batch."""
    model = resolve_model(spec)[0]
    plan = _plan(model, nproc)
    result = verify(spec, plan=plan, nproc=nproc, batch_size=batch, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("spec", ["hf-tiny:opt", "tests.portability.natural:flat_mlp"])
def test_flattened_tokens_collectives_equal_the_prediction(spec: str) -> None:
    plan = _plan(resolve_model(spec)[0], 2)
    model, inputs, _ = resolve_model(spec, device="cpu", batch_size=2, seq_len=16)
    result = simulate(model, plan, inputs or (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
