"""Blocks that call their children's ``forward`` directly, as Meta's Llama reference code and
mistral-inference do (``h = x + self.attention.forward(self.attention_norm(x), ...)``): no
module hook runs for the attention, so the local check finds the failing code in the block,
and the head counts to make local (``self.attention.n_heads``, ``n_kv_heads``, ``n_rep``)
are the block's children's. Before, only the block's own integer attributes were tried: at
tp=4 with 2 kv heads every Linear of every layer was ``colwise_gather_output`` and the layers
ran on whole activations."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import llama_reference, mistral_reference

_TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
_KV = {2: {"colwise"}, 4: {"colwise_kv_gathered", "colwise_kv_replicated"}}


@pytest.mark.parametrize("build", [llama_reference.Model, mistral_reference.Model])
@pytest.mark.parametrize("tp", [2, 4])
def test_attention_is_split_by_heads_with_kv_heads_in_groups(build, tp: int) -> None:
    torch.manual_seed(0)
    model = build()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(_TOKENS,), explain=False)
    styles = {k.replace("layers.*", "layers.0"): v for k, v in plan.module_styles().items()}
    attn, ff = "layers.0.attention", "layers.0.feed_forward"
    assert (styles[f"{attn}.wq"], styles[f"{attn}.wo"]) == ("colwise", "rowwise"), styles
    assert {styles[f"{attn}.wk"], styles[f"{attn}.wv"]} <= _KV[tp], styles
    assert (styles[f"{ff}.w1"], styles[f"{ff}.w3"], styles[f"{ff}.w2"]) == ("colwise", "colwise", "rowwise"), styles
    assert not plan.warnings, plan.warnings
    assert any(k.startswith("attention.n_heads") and v == 4 // tp for a in plan.attributes for k, v in a.values.items()), \
        plan.attributes
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_a_plan_file_sets_a_childs_attribute_and_is_validated(tmp_path) -> None:
    from shardplan.plan.model import load_plan
    from shardplan.plan.validate import check_findings

    model = mistral_reference.Model()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(_TOKENS,), explain=False)
    plan.save(tmp_path / "plan.yaml")
    loaded = load_plan(tmp_path / "plan.yaml")
    assert loaded.attributes == plan.attributes
    assert check_findings(loaded, model) == []


@pytest.mark.parametrize("nproc", [2, 4])
def test_matches_one_process_on_gloo(nproc: int) -> None:
    result = verify("tests.portability.mistral_reference:Model", nproc=nproc, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
