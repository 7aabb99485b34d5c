"""Whole experts on the tp axis (``moe_whole_experts``, issue 31 item 3): rank r of tp holds
experts [r E/tp, (r + 1) E/tp) whole and runs them on the rows routed to them; the tp ranks
share their tokens, and one all-reduce sums their outputs, as ``moe_tp_experts``' does. The
cost model picks between the two per model and tp: whole experts move 1/tp of the routed
rows, but the busiest rank sets the pace (uniform routing's expected largest share)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import shardplan
from shardplan.analyze.graph import expert_params
from shardplan.decide.weights import busiest_share
from shardplan.tools.launch import run_on_gloo
from shardplan.tools.simulate import simulate
from tests import _ep_workers as w

pytest.importorskip("transformers")
from shardplan.interop.hf_models import build_hf_model  # noqa: E402

STYLES = ("moe_tp_experts", "moe_whole_experts")


def _banks(model) -> dict[str, str]:
    return {re.sub(r"\.\d+\.", ".*.", n): "" for n, m in model.named_modules() if expert_params(m) is not None}


def _pinned(model_type: str, mesh: dict, style: str, **build):
    model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="cpu", seed=0, **build)
    pins = {b: style for b in _banks(model)}
    return model, inputs, kwargs, shardplan.price_styles(model, mesh, pins, example_inputs=inputs, example_kwargs=kwargs)


def test_busiest_share_is_one_rank_or_many_rows_and_grows_as_rows_shrink() -> None:
    assert busiest_share(1000, 1) == 1.0
    assert busiest_share(16384, 8) == pytest.approx(1 + math.sqrt(2 * math.log(8)) * math.sqrt(7 / 16384))
    assert 1.0 < busiest_share(10 ** 7, 8) < busiest_share(16384, 8) < busiest_share(64, 8) <= 8


@pytest.mark.parametrize(("model_type", "batch", "want"), [
    ("qwen3_moe", 2, "moe_whole_experts"),  # 128 experts of 768: narrow experts, many rows per rank
    ("mixtral", 1, "moe_tp_experts"),  # 8 experts, 1 per rank, on 32 routed rows: the busiest rank waits
])
def test_the_cost_model_picks_per_model_and_batch_at_tp_8(model_type: str, batch: int, want: str) -> None:
    """Full-size configs on meta, bf16. Qwen3-MoE 30B-A3B at 2 x 2048 tokens: whole experts;
    Mixtral 8x7B at a decode step's 1 x 16 tokens: split inside every expert."""
    model, inputs, kwargs = build_hf_model(model_type, device="meta", batch_size=batch, seq_len=2048 if batch == 2 else 16)
    plan = shardplan.plan_model(model, {"tp": 8}, example_inputs=inputs, example_kwargs=kwargs, dtype="bf16",
                                explain=False)
    styles = {s for m, s in plan.module_styles().items() if m.endswith("mlp.experts")}
    assert styles == {want}, styles
    other = next(s for s in STYLES if s != want)
    pinned = shardplan.price_styles(model, {"tp": 8}, {b: other for b in _banks(model)}, example_inputs=inputs,
                                    example_kwargs=kwargs, dtype="bf16")
    assert pinned.estimate.step_time_s > plan.estimate.step_time_s
    assert pinned.estimate.collectives == plan.estimate.collectives  # the same all-reduces either way


def test_an_ep_mesh_keeps_its_banks_whole_over_ep_not_over_tp() -> None:
    model, inputs, kwargs = build_hf_model("mixtral", tiny=True, device="meta")
    plan = shardplan.plan_model(model, {"ep": 2, "tp": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    assert "moe_whole_experts" not in set(plan.module_styles().values())
    with pytest.raises(shardplan.PlanningError, match="on a mesh without an ep axis"):
        shardplan.price_styles(model, {"ep": 2, "tp": 2}, {b: "moe_whole_experts" for b in _banks(model)},
                               example_inputs=inputs, example_kwargs=kwargs)


@pytest.mark.parametrize(("model_type", "tp"), [("mixtral", 2), ("mixtral", 4), ("llama4_text", 2), ("deepseek_v3", 2)])
def test_collectives_equal_the_prediction(model_type: str, tp: int) -> None:
    """One all-reduce forward per bank call and the tokens' and routing weights' gradients
    all-reduced backward, as moe_tp_experts; counted on the fake group."""
    model, inputs, kwargs, plan = _pinned(model_type, {"tp": tp}, "moe_whole_experts")
    result = simulate(model, plan, inputs, kwargs)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_plan_file_round_trips() -> None:
    _, _, _, plan = _pinned("mixtral", {"tp": 2}, "moe_whole_experts")
    loaded = shardplan.Plan.from_yaml(plan.to_yaml())
    assert loaded.module_styles() == plan.module_styles()
    assert "moe_whole_experts" in set(loaded.module_styles().values())


@pytest.mark.parametrize(("mesh", "fsdp"), [({"tp": 2}, False), ({"dp": 2, "tp": 2}, True)])
def test_whole_experts_match_one_process_on_gloo(mesh: dict, fsdp: bool) -> None:
    """Mixtral, Qwen3-MoE and DeepSeek-V3 (shared experts, grouped routing): logits and every
    gradient within 1e-5 of one process, the weights after 2 AdamW steps within 5e-4; each
    rank holds E/tp experts of each bank."""
    cases = []
    for model_type in ("mixtral", "qwen3_moe", "deepseek_v3"):
        model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="meta")
        pins = {b: "moe_whole_experts" for b in _banks(model)}
        cases.append((model_type, shardplan.price_styles(model, mesh, pins, example_inputs=inputs,
                                                         example_kwargs=kwargs).to_yaml()))
    world = math.prod(mesh.values())
    for rank, got in enumerate(run_on_gloo(w.planned_families, world_size=world, args=(cases, fsdp, tuple(mesh)),
                                           timeout_s=300)):
        for model_type, res in got.items():
            assert res["logits"] < 1e-5 and max(res["grads"].values()) < 1e-5, (model_type, rank, res["logits"])
            assert max(res["weights"].values()) < 5e-4, (model_type, sorted(res["weights"].items(), key=lambda kv: -kv[1])[:3])
            banks = [p for n, p in res["placements"].items() if ".experts." in n and "shared" not in n]
            assert banks and all("Shard(dim=0)" in p for p in banks), (model_type, banks)


def test_rows_sorted_by_expert_match_one_process_on_gloo() -> None:
    """torchtitan's call, ``experts(num_tokens_per_expert, rows sorted by expert)``: each rank
    runs the run of rows its experts own and leaves zeros for the others' rows."""
    from shardplan.tools.verify import verify
    from tests.portability.titan_moe import titan_moe

    with torch.device("meta"):
        model = titan_moe()
    plan = shardplan.price_styles(model, {"tp": 2}, {"layers.*.moe.experts": "moe_whole_experts"},
                                  example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    result = verify("tests.portability.titan_moe:titan_moe", plan=plan, nproc=2, timeout_s=300, seq_len=16)
    assert plan.module_styles()["layers.0.moe.experts"] == "moe_whole_experts"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
