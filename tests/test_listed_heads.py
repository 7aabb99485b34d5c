"""Attention written as a list of head modules (Karpathy's "Let's build GPT": ``proj(cat([h(x)
for h in self.heads], -1))``): planned ``listed_heads``, each rank holding its heads whole and
the projection rowwise, so attention runs split by heads. Before, every head's key, query and
value Linear was ``colwise_gather_output`` and every head ran whole on every rank."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import shardplan
from shardplan.plan.model import load_plan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import listed_heads

_TOKENS = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
_SPEC = "tests.portability.listed_heads"


def _plan(model: nn.Module, tp: int, **opts) -> shardplan.Plan:
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False, **opts)


def _styles(plan: shardplan.Plan, *names: str) -> set[str]:
    return {r.style for r in plan.rules if any(n in r.module for n in names)}


def _meta(build, **kw) -> nn.Module:
    with torch.device("meta"):
        return build(**kw)


@pytest.mark.quick
@pytest.mark.parametrize("build, heads, tp", [(listed_heads.lecture_gpt, 6, 2), (listed_heads.lecture_gpt, 6, 3),
                                              (listed_heads.MaskedEncoder, 4, 2), (listed_heads.MaskedEncoder, 4, 4)])
def test_each_rank_holds_its_heads_whole(build, heads: int, tp: int) -> None:
    plan = _plan(_meta(build, heads=heads), tp)
    assert _styles(plan, ".sa", "attn.") == {"listed_heads"}, plan.warnings
    assert _styles(plan, "ffwd.net.0") <= {"colwise"} and _styles(plan, "ffwd.net.2") <= {"rowwise"}
    assert not [w for w in plan.warnings if "whole" in w or "replicated" in w], plan.warnings


@pytest.mark.quick
def test_at_the_lecture_size_and_at_8b_size() -> None:
    """The lecture's own config (dim 384, 6 heads, 6 layers, block 256) at tp=6; dim 4096 with
    32 heads of 128 in 32 layers at tp=8 (meta), planned in seconds."""
    plan = _plan(_meta(listed_heads.GPTLanguageModel), 6)
    assert _styles(plan, ".sa") == {"listed_heads"}, plan.warnings
    start = time.process_time()
    plan = _plan(_meta(listed_heads.GPTLanguageModel, vocab_size=32000, n_embd=4096, n_head=32, n_layer=32,
                       block_size=2048), 8)
    assert _styles(plan, ".sa") == {"listed_heads"}, plan.warnings
    assert time.process_time() - start < 30


@pytest.mark.quick
def test_heads_tp_does_not_divide_stay_whole_and_say_so() -> None:
    plan = _plan(_meta(listed_heads.lecture_gpt), 4)
    assert _styles(plan, ".sa") == {"replicate"}
    assert any("its 6 heads run whole on every rank: tp=4 does not divide them; use a tp that divides 6" in w
               for w in plan.warnings), plan.warnings


class _ResidualInside(listed_heads.MultiHeadAttention):
    def forward(self, x):  # the input read beside the heads: its gradient is not the heads' share
        return x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class _HeadsOnANormedInput(listed_heads.MultiHeadAttention):
    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


@pytest.mark.quick
@pytest.mark.parametrize("cls, why", [(_ResidualInside, "its code reads its input outside its heads too"),
                                      (_HeadsOnANormedInput, "its heads are not all called on the module's own inputs")])
def test_calls_of_another_form_stay_whole_and_say_why(cls, why: str) -> None:
    model = _meta(listed_heads.lecture_gpt)
    for block in model.blocks:
        block.sa.__class__ = cls
    plan = _plan(model, 2)
    assert _styles(plan, ".sa") == {"replicate"}
    assert any(why in w for w in plan.warnings), plan.warnings


def test_the_user_model_is_left_as_it_was() -> None:
    model = listed_heads.lecture_gpt()
    before = {n: (t.device, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    modules = dict(model.named_modules())
    _plan(model, 2)
    after = {n: (t.device, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert before == after and dict(model.named_modules()) == modules
    assert all(not h._forward_hooks and not h._forward_pre_hooks for h in model.modules())


@pytest.mark.parametrize("build, opts", [(listed_heads.lecture_gpt, {}), (listed_heads.lecture_gpt, {"sequence_parallel": True}),
                                         (listed_heads.MaskedEncoder, {"sequence_parallel": True})])
def test_counted_collectives_equal_the_prediction(build, opts: dict, tmp_path) -> None:
    model = build()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), explain=False, **opts)
    plan.save(tmp_path / "plan.yaml")
    counted = simulate(model, load_plan(tmp_path / "plan.yaml"), (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_with_fsdp_over_a_data_axis_counts_what_it_predicts() -> None:
    model = listed_heads.lecture_gpt()
    tokens = torch.cat([_TOKENS, _TOKENS])
    plan = shardplan.plan_model(model, {"dp": 2, "tp": 2}, example_inputs=(tokens,), explain=False)
    assert _styles(plan, ".sa") == {"listed_heads"}
    counted = simulate(model, plan, (tokens,), fsdp=True)
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("builder, opts", [("lecture_gpt", {}), ("MaskedEncoder", {"sequence_parallel": True})])
def test_matches_one_process_on_gloo(builder: str, opts: dict) -> None:
    result = verify(f"{_SPEC}:{builder}", nproc=2, timeout_s=300, **opts)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert {r.style for r in result.plan.rules if ".sa" in r.module or "attn" in r.module} == {"listed_heads"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_adamw_steps_then_dcp_save_at_tp2_load_at_tp3_and_unsharded(tmp_path) -> None:
    """After two AdamW steps every weight equals one process's (each head from the rank that
    holds it); the tp=2 checkpoint loads at tp=3 (heads 0-2 | 3-5 -> 0-1 | 2-3 | 4-5) and
    into the unsharded model exactly."""
    import torch.distributed.checkpoint as dcp

    from shardplan.tools.launch import run_on_gloo
    from tests import _train_save_workers as w

    builder, folder = f"{_SPEC}:lecture_gpt", str(tmp_path / "ckpt")
    plans = {tp: _plan(listed_heads.lecture_gpt(), tp).to_yaml() for tp in (2, 3)}
    saved = run_on_gloo(w.train_and_save, world_size=2, args=(builder, plans[2], folder), timeout_s=240)[0]
    assert sorted(saved["sharded"]) == sorted(saved["whole"])
    for name, want in saved["whole"].items():
        torch.testing.assert_close(saved["sharded"][name], want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    loaded = run_on_gloo(w.load_and_report, world_size=3, args=(builder, plans[3], folder), timeout_s=240)[0]
    bad = [k for k, v in saved["sharded"].items() if not torch.equal(loaded["model"][k], v)]
    assert not bad, f"{len(bad)} tensors differ after the tp=2 -> tp=3 round trip, e.g. {bad[:3]}"
    whole = listed_heads.lecture_gpt()
    state = {"model": whole.state_dict()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    whole.load_state_dict(state["model"])
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in saved["sharded"].items())
    torch.testing.assert_close(loaded["logits"], whole(w.TOKENS)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.quick
def test_hugging_face_tp_plan_refuses_it_in_one_line() -> None:
    model = _meta(listed_heads.lecture_gpt)
    with pytest.raises(ValueError, match="style 'listed_heads' has no Hugging Face tp_plan counterpart"):
        _plan(model, 2).to_hf_tp_plan(model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_checkpoint_reads_each_ranks_heads_from_safetensors(tmp_path) -> None:
    from safetensors.torch import save_file

    from shardplan.tools.launch import run_on_gloo
    from tests import _train_save_workers as w

    torch.manual_seed(0)
    whole = listed_heads.lecture_gpt()
    state = {k: v.contiguous() for k, v in whole.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    plan = _plan(listed_heads.lecture_gpt(), 2).to_yaml()
    got = run_on_gloo(w.load_safetensors, world_size=2, timeout_s=240,
                      args=(f"{_SPEC}:lecture_gpt", plan, str(tmp_path / "model.safetensors")))[0]["model"]
    assert sorted(got) == sorted(state)
    assert all(torch.equal(got[k], v) for k, v in state.items())
