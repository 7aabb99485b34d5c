"""Attention on raw ``nn.Parameter`` weights its own code multiplies (``F.linear(x, self.wq)``,
``x @ self.wq``, a DenseGeneral ``einsum`` kernel): planned ``dtensor_weights``, split by heads
(first products' weights on the dim they keep, second products' on the dim they contract),
and run on DTensors in the code's own global sizes. Before, each such module was replicated."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.model import load_plan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import raw_weights

_TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
_HEADS_SPLIT = {
    "linear_params": {"layers.*.attn": {"wq": "Shard(0)", "wk": "Shard(0)", "wv": "Shard(0)", "wo": "Shard(1)",
                                        "bq": "Shard(0)", "bv": "Shard(0)"}},
    "linear_params_gqa": {"layers.*.attn": {"wq": "Shard(0)", "wk": "Shard(0)", "wv": "Shard(0)", "wo": "Shard(1)",
                                            "bq": "Shard(0)", "bv": "Shard(0)"}},
    "matmul_params": {"layers.*.attn": {"wq": "Shard(1)", "wk": "Shard(1)", "wv": "Shard(1)", "wo": "Shard(0)"}},
    "dense_general": {**{f"layers.*.attn.{n}": {"kernel": "Shard(1)"} for n in ("query", "key", "value")},
                      "layers.*.attn.out": {"kernel": "Shard(0)"}},
    "qk_norm_modules": {"layers.*.attn": {"wq": "Shard(0)", "wk": "Shard(0)", "wv": "Shard(0)", "wo": "Shard(1)",
                                          "q_norm.weight": "Replicate", "k_norm.weight": "Replicate"}},
    "raw_llama": {"layers.*.attn": {"wq": "Shard(0)", "wk": "Shard(0)", "wv": "Shard(0)", "wo": "Shard(1)",
                                    "q_norm": "Replicate", "k_norm": "Replicate"},
                  "layers.*.mlp": {"w1": "Shard(0)", "w3": "Shard(0)", "w2": "Shard(1)"}},
    "raw_blocks": {"layers.*": {"w_qkv_q": "Shard(0)", "w_k": "Shard(0)", "w_v": "Shard(0)", "w_o": "Shard(1)",
                                "w_up": "Shard(0)", "w_down": "Shard(1)", "ln1": "Replicate", "ln2": "Replicate"}},
    "raw_mqa": {"layers.*.attn": {"wq": "Shard(0)", "wk": "Replicate", "wv": "Replicate", "wo": "Shard(1)",
                                  "q_norm": "Replicate", "k_norm": "Replicate"},
                "layers.*.mlp": {"w1": "Shard(0)", "w3": "Shard(0)", "w2": "Shard(1)"}},
}


def _split_weights(plan: shardplan.Plan) -> dict[str, dict[str, str]]:
    """``dtensor_weights`` layouts by module, blocks named ``layers.*`` (blocks that differ only
    in how their input arrives, whole or as sequence shards, have a rule each); blocks that
    split their weights differently would leave two entries and fail the comparison."""
    import re

    got: dict[str, list] = {}
    for r in plan.rules:
        if r.style == "dtensor_weights":
            name = re.sub(r"^layers\.(\d+|\{[\d,-]+\}|\*)", "layers.*", r.module)
            got.setdefault(name, [])
            if r.param_layouts not in got[name]:
                got[name].append(r.param_layouts)
    return {k: v[0] if len(v) == 1 else v for k, v in got.items()}


def _plan(builder: str, tp: int, *, dim: int = 96, heads: int = 12, **opts) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(raw_weights, builder)(dim=dim, heads=heads)
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False, **opts)


@pytest.mark.quick
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("builder", sorted(_HEADS_SPLIT))
def test_raw_weights_are_split_by_heads(builder: str, tp: int) -> None:
    plan = _plan(builder, tp)
    assert _split_weights(plan) == _HEADS_SPLIT[builder], plan.warnings
    assert not [w for w in plan.warnings if "replicated" in w or "whole" in w], plan.warnings


def test_at_real_size_and_an_odd_tp() -> None:
    """Dim 4096 with 32 heads at tp=8; 6 heads at tp=3; 8 heads of 16 (head_dim / 2 == heads) at tp=2."""
    for builder, tp, dim, heads in [("linear_params", 8, 4096, 32), ("matmul_params", 3, 48, 6), ("dense_general", 2, 128, 8)]:
        plan = _plan(builder, tp, dim=dim, heads=heads)
        assert _split_weights(plan) == _HEADS_SPLIT[builder], (builder, plan.warnings)


def test_heads_tp_does_not_divide_stay_whole_and_say_so() -> None:
    plan = _plan("linear_params", 5, dim=96, heads=12)
    assert not [r for r in plan.rules if r.style == "dtensor_weights"]
    assert any("LinearParams has no tensor-parallel style; replicated" in w for w in plan.warnings), plan.warnings


def test_the_user_model_is_left_as_it_was() -> None:
    model = raw_weights.matmul_params()
    before = {n: (t.device, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), explain=False)
    after = {n: (t.device, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert before == after


@pytest.mark.parametrize("builder", sorted(_HEADS_SPLIT))
def test_counted_collectives_equal_the_prediction(builder: str, tmp_path) -> None:
    model = getattr(raw_weights, builder)()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), explain=False)
    plan.save(tmp_path / "plan.yaml")
    counted = simulate(model, load_plan(tmp_path / "plan.yaml"), (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("builder", sorted(_HEADS_SPLIT))
def test_sequence_parallel_counts_what_it_predicts(builder: str) -> None:
    """Norms on sequence shards; the attention's input gathered once (DenseGeneral's q, k and v
    share one gather, a region's), its partial output reduce-scattered back."""
    model = getattr(raw_weights, builder)()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(_TOKENS,), explain=False, sequence_parallel=True)
    assert plan.module_styles().get("layers.0.norm1", "sequence_parallel") == "sequence_parallel"  # raw_blocks: no norm modules
    assert _split_weights(plan) == _HEADS_SPLIT[builder]
    counted = simulate(model, plan, (_TOKENS,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


@pytest.mark.parametrize("builder", sorted(_HEADS_SPLIT))
def test_raw_weights_match_one_process_on_gloo(builder: str) -> None:
    result = verify(f"tests.portability.raw_weights:{builder}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("builder", ["matmul_params", "dense_general"])
def test_sequence_parallel_matches_one_process_on_gloo(builder: str) -> None:
    result = verify(f"tests.portability.raw_weights:{builder}", nproc=2, timeout_s=300, sequence_parallel=True)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_adamw_steps_then_dcp_save_at_tp2_load_at_tp4(tmp_path) -> None:
    """After two AdamW steps every weight equals one process's; the tp=2 checkpoint loads at
    tp=4 exactly, and its logits equal the unsharded model's with those weights."""
    from shardplan.tools.launch import run_on_gloo
    from tests import _train_save_workers as w

    builder, folder = "linear_params", str(tmp_path / "ckpt")
    plans = {tp: _plan(builder, tp).to_yaml() for tp in (2, 4)}
    saved = run_on_gloo(w.train_and_save, world_size=2, args=(builder, plans[2], folder), timeout_s=240)[0]
    assert sorted(saved["sharded"]) == sorted(saved["whole"])
    for name, want in saved["whole"].items():  # Adam's step is ~lr (1e-3) even for a gradient near 0
        torch.testing.assert_close(saved["sharded"][name], want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    loaded = run_on_gloo(w.load_and_report, world_size=4, args=(builder, plans[4], folder), timeout_s=240)[0]
    bad = [k for k, v in saved["sharded"].items() if not torch.equal(loaded["model"][k], v)]
    assert not bad, f"{len(bad)} tensors differ after the tp=2 -> tp=4 round trip, e.g. {bad[:3]}"
    whole = w._model(builder, 3)
    whole.load_state_dict(saved["sharded"])
    with torch.no_grad():
        torch.testing.assert_close(loaded["logits"], whole(w.TOKENS), atol=1e-5, rtol=1e-5)


def test_with_fsdp_over_a_data_axis_counts_what_it_predicts() -> None:
    """dp=2 x tp=2 with ``fully_shard``: FSDP gathers the tp shards of the raw weights and
    reduce-scatters their gradients; the whole per-head norm weights' Partial gradients go
    through FSDP's reduction too."""
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    model = raw_weights.raw_llama()
    plan = shardplan.plan_model(model, {"dp": 2, "tp": 2}, example_inputs=(tokens,), explain=False)
    counted = simulate(model, plan, (tokens,), fsdp=True)
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"
