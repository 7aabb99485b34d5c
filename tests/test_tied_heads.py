"""An output head tied to the token embedding by reading its weight in code
(``F.linear(x, self.wte.weight)``, ``x @ self.tok_emb.weight.T``, torchtune's ``TiedLinear``):
the table is split by vocabulary rows (``embedding_rowwise``) and the head computes each
rank's vocabulary, Megatron's way. Before, the table stayed whole on every rank with a
warning ("a tied weight used outside the module"): at torchtune's Llama 3.2 1B size 128256 x
2048, 1 GiB in bf16 on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardplan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import tied_heads

_TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
_SPEC = "tests.portability.tied_heads"


def _plan(model: nn.Module, tp: int, **opts) -> shardplan.Plan:
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(_TOKENS,), explain=False, **opts)


def _table(plan: shardplan.Plan) -> str:
    return next(r.style for r in plan.rules if r.read_outside)


@pytest.mark.quick
@pytest.mark.parametrize("build", [tied_heads.LinearTiedGPT, tied_heads.MatmulTiedLM, tied_heads.tune_llama3_2])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_table_is_split_by_vocabulary_and_counts_match(build, tp: int) -> None:
    model = build()
    plan = _plan(model, tp)
    assert _table(plan) == "embedding_rowwise"
    assert not [w for w in plan.warnings if "not sharded" in w or "skipped" in w], plan.warnings
    counted = simulate(model, plan, (_TOKENS,))
    # the head's logits all-gathered once; the gradient of its input all-reduced once
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
    assert counted.counted["forward"]["all_gather"] >= 1


def test_an_attention_given_one_value_in_two_slots_sums_its_gradient_once() -> None:
    """torchtune calls ``self.attn(h, h, ...)`` (x for q, y for k and v): the region gives both
    slots the one DTensor, so q's, k's and v's input gradients add up there and one all-reduce
    sums them; before, y stayed plain and k and v each all-reduced their own (2 more per layer)."""
    model = tied_heads.tune_llama3_2(tied=False)
    plan = _plan(model, 2)
    assert any(r.module == "layers.*.attn" and r.num_inputs == 2 for r in plan.regions), plan.regions
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
    # one per attention, one per MLP, one for the head: 2 layers
    assert counted.counted["backward"]["all_reduce"] == 5


def test_at_llama_3_2_1b_width_the_table_is_one_tp_th_per_rank() -> None:
    with torch.device("meta"):  # Llama 3.2 1B's vocabulary and width (its RoPE cache is not built on meta)
        model = tied_heads.LinearTiedGPT(vocab_size=128256, dim=2048, n_head=32, n_layer=2, block_size=2048)
    tokens = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    plan = shardplan.plan_model(model, {"tp": 8}, example_inputs=(tokens,), explain=False)
    assert _table(plan) == "embedding_rowwise"
    whole = 128256 * 2048 * 4
    assert plan.estimate.param_bytes_per_device < whole / 2  # the table alone, whole, would be 1 GiB in fp32 at 2 layers


def test_a_vocabulary_tp_does_not_divide_stays_whole_and_says_so() -> None:
    plan = _plan(tied_heads.odd_vocab_gpt(), 2)
    assert _table(plan) == "replicate"
    assert any("wte: weight [251, 64] not sharded" in w for w in plan.warnings)


def test_planning_leaves_the_model_as_it_was() -> None:
    model = tied_heads.MatmulTiedLM()
    before = {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()}
    _plan(model, 2)
    assert before == {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("builder", ["LinearTiedGPT", "MatmulTiedLM", "tune_llama3_2"])
def test_matches_one_process_on_gloo(builder: str) -> None:
    result = verify(f"{_SPEC}:{builder}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert _table(result.plan) == "embedding_rowwise"
