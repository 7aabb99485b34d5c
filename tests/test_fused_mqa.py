"""Multi-query attention fused in one Linear: the query heads split, the kv heads whole.

Falcon-7B's ``query_key_value`` (viewed as ``heads + 2`` heads, indexed apart), StarCoder's
``c_attn`` (``split((embed, hd, hd), -1)``) and gpt-fast with one kv head put the kv head after
the query heads in one weight. Planned as Megatron and vLLM run MQA: ``packed_colwise`` with
``packed: [h, 1, 1]`` (rows split tp ways per part at rest) and ``whole_parts: 2`` (k and v
all-gathered in forward, their gradients reduce-scattered), the output projection rowwise;
with fewer kv heads than ranks (2 kv heads at tp=4), ``groups: 2``: each piece gathered over
the ranks of its kv head.
Checked: the plan (natural code, Hugging Face's two, real sizes on meta), predicted
collectives against the fake group's count, one process against 2 and 4 gloo ranks
(outputs, every gradient, weights and AdamW moments after 2 steps), DCP saved at tp=2 and
loaded at tp=4 and unsharded, the plan file's field and the Hugging Face export's refusal.
"""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.sources import resolve_model
from shardplan.plan.model import Plan, PlanFileError
from shardplan.tools.launch import run_on_gloo
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests import _unequal_packed_workers as w
from tests._checks import flat_state
from tests.portability import natural

HD = w.HEAD_DIM


def _plan(model, tp: int, seq: int = 16) -> Plan:
    tokens = torch.zeros(2, seq, dtype=torch.long, device=next(model.parameters()).device)
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)


def _meta(builder):
    with torch.device("meta"):
        return builder()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("builder", "qkv", "o", "packed"), [
    (natural.fused_mqa, "layers.0.wqkv", "layers.0.wo", [8, 1, 1]),
    (natural.falcon_mqa, "layers.0.query_key_value", "layers.0.dense", [8, 1, 1]),
    (natural.litgpt_mqa, "layers.0.attn", "layers.0.proj", [8, 1, 1]),
])
def test_fused_mqa_splits_the_query_heads_and_gathers_the_kv_head(builder, qkv: str, o: str, packed: list, tp: int) -> None:
    plan = _plan(_meta(builder), tp)
    rule = plan.rule_for(qkv)
    assert (rule.style, rule.packed, rule.whole_parts, rule.groups) == ("packed_colwise", packed, 2, None), plan.warnings
    assert plan.rule_for(o).style == "rowwise"
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize("tp", [4, 8])
def test_fused_gqa_with_fewer_kv_heads_than_ranks_gathers_each_in_its_group(tp: int) -> None:
    """8 query heads and 2 kv heads in one ``split([dim, kv, kv])`` (gpt-fast, litgpt today):
    rank r holds [q_r, k_g, v_g], g = r // (tp / 2), each piece gathered over its tp / 2 ranks."""
    plan = _plan(_meta(natural.fused_gqa), tp)
    rule = plan.rule_for("layers.0.wqkv")
    assert (rule.style, rule.packed, rule.whole_parts, rule.groups) == ("packed_colwise", [4, 1, 1], 2, 2), plan.warnings
    assert plan.rule_for("layers.0.wo").style == "rowwise"
    assert not plan.warnings, plan.warnings


@pytest.mark.parametrize(("name", "qkv", "o"), [
    ("hf-tiny:gpt_bigcode", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"),
    ("hf-tiny:falcon", "transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense"),
])
def test_hugging_face_mqa_is_split_by_heads(name: str, qkv: str, o: str) -> None:
    plan = _plan(resolve_model(name)[0], 2)
    rule = plan.rule_for(qkv)
    assert (rule.style, rule.whole_parts, plan.rule_for(o).style) == ("packed_colwise", 2, "rowwise"), plan.warnings
    with pytest.raises(ValueError, match="gathered whole"):
        plan.to_hf_tp_plan()


def test_starcoder_sized_mqa_is_split_by_heads_at_tp_8() -> None:
    """StarCoder's shape (48 heads of 128, 6144 wide, one kv head) at tp=8, 2 layers, on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_bigcode", n_embd=6144, n_head=48, n_layer=2, n_inner=24576, vocab_size=49152,
                               multi_query=True, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = _plan(model, 8, seq=2048)
    rule = plan.rule_for("transformer.h.1.attn.c_attn")
    assert (rule.style, rule.packed, rule.whole_parts) == ("packed_colwise", [48, 1, 1], 2), plan.warnings
    assert plan.rule_for("transformer.h.1.attn.c_proj").style == "rowwise"


@pytest.mark.parametrize(("builder", "tp"), [(natural.fused_mqa, 2), (natural.falcon_mqa, 2), (natural.litgpt_mqa, 4),
                                           (natural.fused_gqa, 4)])
def test_fused_mqa_collectives_equal_the_prediction(builder, tp: int) -> None:
    plan = _plan(_meta(builder), tp)
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    for phase in ("forward", "backward"):
        assert result.counted_bytes[phase] == plan.estimate.collective_bytes[phase], phase


@pytest.mark.parametrize(("spec", "nproc"), [("tests.portability.natural:falcon_mqa", 2), ("hf-tiny:gpt_bigcode", 4),
                                             ("tests.portability.natural:litgpt_mqa", 4), ("tests.portability.natural:fused_gqa", 4)])
def test_fused_mqa_matches_one_process_on_gloo(spec: str, nproc: int) -> None:
    result = verify(spec, nproc=nproc, timeout_s=300)
    assert any(r.whole_parts for r in result.plan.rules), result.plan.module_styles()
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_training_on_two_gloo_ranks_matches_one_process() -> None:
    """A hand-written plan file (``packed: [8, 1, 1], whole_parts: 2``) on GQA code with one kv
    head: logits, every gradient, and weights and AdamW moments after 2 steps."""
    want = w.train(w.build(0, 8, 1))
    got = run_on_gloo(w.train_sharded, world_size=2, args=(w.plan_yaml(2, 8, 1, whole=True), None, 1), timeout_s=240)
    for rank, result in enumerate(got):
        assert result["placements"]["layers.0.attn.wqkv.weight"] == ["PackedShard(dim=0, parts=[8, 1, 1])"]
        torch.testing.assert_close(result["logits"], want["logits"], atol=1e-5, rtol=1e-5)
        _close(result["grads"], want["grads"], f"rank {rank} gradient", atol=1e-5, rtol=1e-4)
        # AdamW divides by sqrt(v): an entry whose gradient is near zero moves by up to ~lr
        # whatever its rounding, so weights are held to 1% of a step (lr 1e-2), gradients to 1e-5
        _close(_no_key_bias(result["weights"]), _no_key_bias(want["weights"]), f"rank {rank} weight", atol=1e-4, rtol=1e-4)
        _close(result["moments"], want["moments"], f"rank {rank} AdamW state", atol=1e-6, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tp2_checkpoint_loads_at_tp4_and_unsharded(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    import safetensors.torch

    folder, file = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    saved = run_on_gloo(w.save_sharded, world_size=2, args=(w.plan_yaml(2, 8, 1, whole=True), folder, 1),
                        timeout_s=240)
    # rank r stores rows [Q_r; K_r; V_r]: 64 query rows, 8 k and 8 v rows, each part cut in 2
    assert [r["chunks"]["layers.0.attn.wqkv.weight"] for r in saved] == [
        [((0, 0), (32, 32)), ((64, 0), (4, 32)), ((72, 0), (4, 32))],
        [((32, 0), (32, 32)), ((68, 0), (4, 32)), ((76, 0), (4, 32))]]
    saved = saved[0]
    plain = w.build(5, 8, 1)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    _exact(plain.state_dict(), saved["model"], "unsharded DCP load")
    safetensors.torch.save_file({k: v.contiguous() for k, v in saved["model"].items()}, file)
    loaded = run_on_gloo(w.load_sharded, world_size=4,
                         args=(w.plan_yaml(4, 8, 1, whole=True), folder, saved["model"], file, 1), timeout_s=240)
    for rank, got in enumerate(loaded):
        _exact(got["dcp"], saved["model"], f"rank {rank}: DCP load at tp=4")
        _exact(got["from_full"], saved["model"], f"rank {rank}: load_full_state_dict at tp=4")
        _exact(got["from_file"], saved["model"], f"rank {rank}: load_checkpoint at tp=4")
    _exact(flat_state(loaded[0]["dcp_optim"]), flat_state(saved["optim"]), "optimizer state at tp=4")
    with torch.no_grad():
        plain.load_state_dict(saved["model"])
        torch.testing.assert_close(loaded[0]["logits"], plain(w.tokens()), atol=1e-5, rtol=1e-5)


def test_whole_parts_in_the_plan_file() -> None:
    text = w.plan_yaml(2, 8, 1, whole=True)
    assert "  whole_parts: 2\n" in text
    assert Plan.from_yaml(Plan.from_yaml(text).to_yaml()).to_yaml() == text
    for bad in ("  whole_parts: 3\n", "  whole_parts: 0\n"):
        with pytest.raises(PlanFileError, match="whole_parts"):
            Plan.from_yaml(text.replace("  whole_parts: 2\n", bad))


def _no_key_bias(state: dict) -> dict:
    """Softmax ignores a bias of the keys: its gradient is rounding noise that Adam scales to
    whole steps, so the key rows [8 hd, 9 hd) of the bias are left out after a step."""
    keep = torch.cat([torch.arange(0, 8 * HD), torch.arange(9 * HD, 10 * HD)])
    return {k: v[keep] if k.endswith("wqkv.bias") else v for k, v in state.items()}


def _close(got: dict, want: dict, what: str, **tol) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for k in want:
        if isinstance(want[k], dict):
            _close(got[k], want[k], f"{what} {k}", **tol)
        else:
            torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def _exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}"
