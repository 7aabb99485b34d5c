"""Hard-coded sizes made local (plan ``attributes``): a module that views q/k/v by
``self.heads`` gets heads / tp on each rank, proven by the local check, instead of running
on whole activations. Plans on meta; numerics on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.validate import check_findings
from shardplan.tools.verify import verify
from tests.portability.heads import DerivedLM, HardCodedLM

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def _plan(tp: int, **kw) -> tuple[HardCodedLM, shardplan.Plan]:
    with torch.device("meta"):
        model = HardCodedLM(**kw)
    return model, shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_count_attribute_takes_its_local_value(tp: int) -> None:
    _, plan = _plan(tp)
    styles = plan.module_styles()
    assert [styles[f"blocks.0.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"], styles
    assert [(a.module, a.values) for a in plan.attributes] == [("blocks.*", {"heads": 4 // tp})]
    assert not plan.warnings, plan.warnings


def test_a_head_count_equal_to_head_dim_is_told_apart_by_the_views() -> None:
    """8 heads of 8: halving ``hd`` would run too, on the wrong heads (views of [b, s, 8, 4]
    where the plan expects [b, s, 4, 8]); only ``heads`` passes the view check."""
    _, plan = _plan(2, heads=8)
    assert [(a.module, a.values) for a in plan.attributes] == [("blocks.*", {"heads": 4})]
    assert not plan.warnings, plan.warnings


def test_a_head_count_equal_to_head_dim_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.heads:hard_coded_lm_8_heads", nproc=2, timeout_s=300)
    assert [a.values for a in result.plan.attributes] == [{"heads": 4}]
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_attributes_round_trip_and_are_checked(tmp_path) -> None:
    model, plan = _plan(2)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    loaded = shardplan.load_plan(path)
    assert loaded.attributes == plan.attributes and check_findings(loaded, model) == []
    bad = loaded.model_copy(update={"attributes": [loaded.attributes[0].model_copy(update={"values": {"n_heads": 2}})]})
    (finding,) = check_findings(bad, model)
    assert "no integer attribute 'n_heads'" in finding and "'heads'" in finding


def test_plans_without_attributes_keep_their_files() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, device="meta"),))
    assert "attributes" not in plan.to_yaml()


def test_local_head_count_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.heads:hard_coded_lm", nproc=2, timeout_s=240)
    assert result.plan.attributes and result.plan.rule_for("blocks.0.q").style == "colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_size_other_sizes_derive_from_is_rewritten_with_them() -> None:
    """head_dim = self.dim // self.heads: halving dim alone runs, on heads half as wide;
    the views the code makes must have the shapes the plan expects, so only both are set."""
    with torch.device("meta"):
        model = DerivedLM()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS)
    assert [(a.module, a.values) for a in plan.attributes] == [("blocks.*", {"dim": 32, "heads": 2})]
    result = verify("tests.portability.heads:derived_lm", nproc=2, timeout_s=240)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_view_with_minus_one_on_the_sequence_gets_the_local_head_count(tp: int) -> None:
    """``view(b, -1, self.heads, hd)`` (OPT) runs on a shard with the global count, its
    -1 absorbing the split into the sequence: the check compares the views with the plan's
    local shapes, so the count is made local instead of the heads being mixed."""
    from tests.portability.heads import sequence_minus_one_lm

    with torch.device("meta"):
        model = sequence_minus_one_lm()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS)
    assert [(a.module, a.values) for a in plan.attributes] == [("blocks.*", {"heads": 4 // tp})], plan.attributes
    assert plan.rule_for("blocks.0.q").style == "colwise" and plan.rule_for("blocks.0.o").style == "rowwise"


def test_a_view_with_minus_one_on_the_sequence_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.heads:sequence_minus_one_lm", nproc=2, timeout_s=240)
    assert result.plan.attributes, result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
