"""Weight modules that are not the stock classes, outside the repeated blocks: the local
check runs them on their shards too, and what fails there is kept whole and run on local
tensors (torchtitan 0.3.0's Embedding reads ``self.weight.to_local()``)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability.custom_leaves import LocalEmbeddingLM

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def _plan(**kw) -> shardplan.Plan:
    with torch.device("meta"):
        model = LocalEmbeddingLM(**kw)
    return shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS)


@pytest.mark.parametrize("layers", [2, 1])  # 1: nothing folds, the check runs the whole model
def test_an_embedding_that_reads_its_local_weight_is_kept_whole(layers: int) -> None:
    plan = _plan(layers=layers)
    styles = plan.module_styles()
    assert styles["embed"] == "replicate" and styles["layers.0.up"] == "colwise", styles
    (note,) = [w for w in plan.warnings if w.startswith("embed:")]
    assert "own forward fails on its shards" in note and "custom_leaves.py" in note


def test_a_weight_read_by_code_outside_its_module_is_kept_whole() -> None:
    plan = _plan(tied=True)
    assert plan.module_styles()["embed"] == "replicate" and plan.rule_for("embed").read_outside
    assert any("other code reads its weight as a plain tensor" in w for w in plan.warnings), plan.warnings


def test_a_weight_read_outside_its_module_matches_one_process_on_gloo() -> None:
    """torchtune's TiedLinear, a plain object, computes with the embedding's weight in the
    root's forward: that weight is its local tensor for the whole forward."""
    result = verify("tests.portability.custom_leaves:tied_lm", nproc=2, timeout_s=240)
    assert result.plan.rule_for("embed").read_outside
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_kept_whole_embedding_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.custom_leaves:local_embedding_lm", nproc=2, timeout_s=240)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
