"""Layers called other ways than as one module: minGPT's MLP, a ``ModuleDict`` run through a
lambda kept as an attribute, and lucidrains' layers, plain ``ModuleList``s that forward
unpacks and calls child by child. Before, minGPT's plan skipped its local check (the check's
copy of a block ran the lambda on the original's modules) and crashed on the ranks, and the
layer lists made ``plan_model`` raise (a list never called was taken as a folded copy of the
first, so its modules had a rule twice)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import layer_lists, mingpt

_TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
_SPLIT = {"colwise", "packed_colwise"}


def _plan(build, tp: int) -> tuple[torch.nn.Module, shardplan.Plan]:
    torch.manual_seed(0)
    model = build()
    return model, shardplan.plan_model(model, {"tp": tp}, example_inputs=(_TOKENS,), explain=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_mingpt_is_split_by_heads_and_checked(tp: int) -> None:
    model, plan = _plan(mingpt.Model, tp)
    styles = plan.module_styles()
    for i in range(2):
        h = f"transformer.h.{i}" if f"transformer.h.{i}.attn.c_attn" in styles else "transformer.h.*"
        assert (styles[f"{h}.attn.c_attn"], styles[f"{h}.attn.c_proj"]) == ("packed_colwise", "rowwise"), styles
        assert (styles[f"{h}.mlp.c_fc"], styles[f"{h}.mlp.c_proj"]) == ("colwise", "rowwise"), styles
    assert not plan.warnings, plan.warnings  # the local check ran: nothing skipped
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_as_lists_forward_unpacks_are_split_by_heads(tp: int) -> None:
    model, plan = _plan(layer_lists.Model, tp)
    styles = plan.module_styles()
    for i in range(2):
        assert {styles[f"layers.{i}.1.to_{p}"] for p in "qkv"} <= _SPLIT and styles[f"layers.{i}.1.to_out"] == "rowwise"
        assert styles[f"layers.{i}.3.ff.0.proj"] == "packed_colwise" and styles[f"layers.{i}.3.ff.2"] == "rowwise"
    assert not plan.warnings, plan.warnings
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_planning_leaves_the_lambda_calling_the_models_own_modules() -> None:
    model, _ = _plan(mingpt.Model, 2)
    block = model.transformer.h[0]
    cells = [c.cell_contents for c in block.mlpf.__closure__]
    assert cells == [block.mlp]


@pytest.mark.parametrize("builder", ["tests.portability.mingpt:Model", "tests.portability.layer_lists:Model"])
def test_matches_one_process_on_gloo(builder: str) -> None:
    result = verify(builder, nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_mingpt_nested_in_a_module_dict_takes_sequence_parallel() -> None:
    """The final norm sits in ``transformer`` beside the layers, so the check stands it in and
    reads the placement of the last (folded) layer's output: a folded copy's outputs are placed
    as its representative's (they were read as whole, and ``sequence_parallel=True`` raised)."""
    torch.manual_seed(0)
    model = mingpt.Model()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), sequence_parallel=True, explain=False)
    norms = {m: s for m, s in plan.module_styles().items() if m.split(".")[-1] in ("ln_1", "ln_2", "ln_f")}
    assert len(norms) == 5 and set(norms.values()) == {"sequence_parallel"}, norms
    assert not plan.warnings, plan.warnings
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_mingpt_under_sequence_parallel_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.mingpt:Model", nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.plan.module_styles()["transformer.ln_f"] == "sequence_parallel"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
