"""Plan files: every error names the file:line, the key, the value given and what is allowed."""

from __future__ import annotations

import time

import pytest

import shardplan
from shardplan import PlanFileError
from shardplan.models import build_preset


@pytest.fixture(scope="module")
def plan_text() -> str:
    return shardplan.plan_model(build_preset("mlp"), {"tp": 2}, explain=False).to_yaml()


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_every_wrong_style_names_the_value_given_and_its_line(plan_text: str) -> None:
    bad = plan_text.replace("style: colwise\n", "style: colwize\n", 1).replace("style: rowwise\n", "style: rowwize\n", 1)
    with pytest.raises(PlanFileError) as exc:
        shardplan.Plan.from_yaml(bad, source="p.yaml")
    first, second = str(exc.value).splitlines()
    assert first.startswith(f"p.yaml:{_line_of(bad, 'colwize')}: rules.0.style: 'colwize' is not allowed; expected one of 'colwise'")
    assert second.startswith(f"p.yaml:{_line_of(bad, 'rowwize')}: rules.1.style: 'rowwize' is not allowed (allowed values as above)")


def test_a_wrong_type_names_the_value_given(plan_text: str) -> None:
    bad = plan_text.replace("  tp: 2\n", "  tp: two\n", 1)
    with pytest.raises(PlanFileError, match=r"p\.yaml:\d+: mesh\.axes\.tp: .*got 'two'"):
        shardplan.Plan.from_yaml(bad, source="p.yaml")


def test_a_key_given_twice_names_both_lines(plan_text: str) -> None:
    line = _line_of(plan_text, "style: colwise")
    bad = plan_text.replace("style: colwise\n", "style: colwise\n  style: rowwise\n", 1)
    with pytest.raises(PlanFileError, match=rf"p\.yaml:{line + 1}: rules\.0\.style: key given twice \(lines {line} and {line + 1}\)"):
        shardplan.Plan.from_yaml(bad, source="p.yaml")


def test_an_alias_bomb_is_refused_at_once() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 12)]
    start = time.perf_counter()
    with pytest.raises(PlanFileError, match=r"b\.yaml:2: a1\.\d+: YAML aliases \(\*name\) are not allowed"):
        shardplan.Plan.from_yaml("\n".join(lines) + "\n", source="b.yaml")
    assert time.perf_counter() - start < 1.0


def test_deep_nesting_is_a_plan_file_error() -> None:
    with pytest.raises(PlanFileError, match="nested deeper"):
        shardplan.Plan.from_yaml("rules: " + "[" * 5000 + "]" * 5000 + "\n", source="d.yaml")


def test_a_root_rule_is_written_with_its_empty_module() -> None:
    from tests.portability.root_param import build
    import torch

    plan = shardplan.plan_model(build(), {"tp": 2}, example_inputs=(torch.zeros(4, 16),), explain=False)
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert again == plan and "" in [r.module for r in again.rules]


def test_a_file_of_many_repeated_rules_is_checked_fast_and_the_repeats_named(tmp_path) -> None:
    import yaml

    from shardplan.plan.validate import check_findings

    model = build_preset("llama3-8b")
    data = shardplan.plan_model(model, {"tp": 8}, explain=False).to_data()
    data["rules"] = [dict(r) for _ in range(2000) for r in data["rules"]]  # 24,000 rules
    start = time.perf_counter()
    plan = shardplan.Plan.from_yaml(yaml.safe_dump(data, sort_keys=False))
    findings = check_findings(plan, model)
    assert time.perf_counter() - start < 30
    assert findings[0].startswith("rule tok_embeddings (embedding_rowwise): the module pattern of rule 0 again")
    assert findings[-1] == f"... and {len(data['rules']) - 12 - 20} more rules that repeat a module pattern"


def test_tokens_of_scatters_only_a_partial_output_onto_the_sequence() -> None:
    """``tokens_of`` (a module's flattened tokens reduce-scattered) qualifies a module's exit,
    Partial -> Shard(1), and names an argument."""
    from shardplan.plan.model import Region

    exit_ = Region(module="layers.*.moe", input="output", num_inputs=0, input_layouts="Partial",
                   desired_input_layouts="Shard(1)", use_local_output=True, tokens_of=0, output_index=0, num_outputs=2)
    assert exit_.tokens_of == 0
    with pytest.raises(ValueError, match=r"tokens_of 0 with input 'output', Partial -> Shard\(0\): tokens_of reduce-scatters"):
        Region(module="layers.*.moe", input="output", num_inputs=0, input_layouts="Partial",
               desired_input_layouts="Shard(0)", tokens_of=0)
    with pytest.raises(ValueError, match=r"tokens_of 'x' with input 0, Shard\(1\) -> Replicate"):
        Region(module="layers.*.moe", input=0, num_inputs=1, input_layouts="Shard(1)", tokens_of="x")


def test_a_fold_cuts_only_a_whole_input() -> None:
    """``fold`` (heads folded into the batch) qualifies a slice, Replicate -> Shard(d) at an input."""
    from shardplan.plan.model import Region

    cut = Region(module="h.*.attn", input="alibi", num_inputs=1, desired_input_layouts="Shard(0)", fold=4,
                 use_local_output=True)
    assert cut.fold == 4
    with pytest.raises(ValueError, match=r"fold 4 with input 'output', Replicate -> Shard\(1\): a fold cuts a module's whole input"):
        Region(module="h.*.attn", input="output", num_inputs=0, desired_input_layouts="Shard(1)", fold=4)
    with pytest.raises(ValueError, match=r"fold 4 with input 0, Shard\(1\) -> Replicate"):
        Region(module="h.*.attn", input=0, num_inputs=1, input_layouts="Shard(1)", fold=4)
