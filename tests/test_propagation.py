"""Op strategies from DTensor's sharding propagation (shardplan.decide.propagation), and
the frontier layouts it unlocked: expert banks with biases and interleaved gate/up
(gpt-oss), Llama 4's bmm experts beside a router that overrides nn.Linear.forward.

Plans are made on the meta device; numerics run on 2 gloo ranks against one process."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardplan
from shardplan.analyze.graph import expert_params
from shardplan.api import _graph
from shardplan.decide import propagation
from shardplan.tools.verify import verify
from tests.portability.dtensor_ops import ChunkedAttention, EinsumModel, LiteralReshape, chunked_model
from tests.portability.experts import Interleaved, interleaved_moe

os.environ["HF_HUB_OFFLINE"] = "1"


def _tokens(batch: int = 2, seq: int = 16) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def test_einsum_complex_rope_attention_is_split_by_heads() -> None:
    """view_as_complex, view_as_real, repeat_interleave and einsum have no hand rule: before
    DTensor answered for them, every attention Linear here was colwise_gather_output."""
    with torch.device("meta"):
        model = EinsumModel()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=_tokens(), explain=False)
    styles = plan.module_styles()
    for layer in (0, 1):
        assert {styles[f"layers.{layer}.attn.w{n}"] for n in "qkv"} == {"colwise"}, styles
        assert styles[f"layers.{layer}.attn.wo"] == "rowwise", styles
    assert not plan.warnings, plan.warnings


def _op(graph, target: str):
    return next(op for op in graph.ops if op.target == target)


def test_probe_checks_the_local_run_and_needs_no_collective() -> None:
    """DTensor reshapes a DTensor by its global shape; a literal ``reshape(2, 16, 4, 16)``
    on a local shard does not, so no sharded strategy passes. ``roll`` along an unsharded
    dim is local; DTensor would all-gather for a roll along the sharded one."""
    with torch.device("meta"):
        model = LiteralReshape()
    graph = _graph(model, (torch.zeros(2, 16, 64, device="meta"),), None, {})
    reshape, roll = _op(graph, "reshape"), _op(graph, "roll")
    assert propagation.dtensor_strategies(reshape, graph, tp=2) == []
    found = dict(propagation.dtensor_strategies(roll, graph, tp=2))
    assert found[("S2",)] == "S2" and found[("S0",)] == "S0", found
    assert ("S3",) not in found  # rolled along dim 3: a shard would need its neighbour's slice


def test_probe_answers_the_same_under_a_process_group() -> None:
    """The probe's mesh has no process group: a caller's group (any rank) changes nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with torch.device("meta"):
        model = EinsumModel()
    graph = _graph(model, _tokens(), None, {})
    ops = [op for op in graph.ops if op.target in ("view_as_complex", "einsum", "repeat_interleave", "view_as_real")]
    assert len(ops) >= 8
    propagation._cache.clear()
    alone = [propagation.dtensor_strategies(op, graph, tp=4) for op in ops]
    propagation._cache.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        grouped = [propagation.dtensor_strategies(op, graph, tp=4) for op in ops]
    finally:
        dist.destroy_process_group()
    assert alone == grouped and all(alone), alone


def test_einsum_model_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.dtensor_ops:einsum_model", nproc=2, timeout_s=240)
    assert {"colwise", "rowwise"} <= set(result.plan.module_styles().values())
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_write_into_a_tensor_split_by_heads_stays_on_the_shards() -> None:
    """``out[:, :, i] = v`` (setitem, no result) on a buffer split by heads: DTensor writes each
    rank's shard with no collective wherever the index leaves the split dim whole; a split
    along the indexed dim (2) would need another rank's rows, and is refused."""
    with torch.device("meta"):
        model = ChunkedAttention()
    graph = _graph(model, (torch.zeros(2, 16, 64, device="meta"),), None, {})
    write = _op(graph, "setitem")
    assert [graph.values[v].shape for v in write.inputs] == [(2, 8, 4, 4, 8), (2, 8, 4, 8)]
    found = propagation.in_place_strategies(write, graph, tp=2)
    assert set(found) == {("S0", "S0"), ("S1", "S1"), ("S3", "S2"), ("S4", "S3")}, found


@pytest.mark.parametrize("tp", [2, 4])
def test_chunked_attention_is_split_by_heads(tp: int) -> None:
    """Before in-place writes were probed, every attention Linear here was gathered."""
    with torch.device("meta"):
        model = chunked_model()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=_tokens(), explain=False)
    styles = plan.module_styles()
    assert {styles[f"layers.{i}.attn.w{n}"] for i in (0, 1) for n in "qkv"} == {"colwise"}, styles
    assert {styles[f"layers.{i}.attn.wo"] for i in (0, 1)} == {"rowwise"}, styles
    assert not plan.warnings, plan.warnings


def test_chunked_attention_matches_one_process_on_gloo() -> None:
    result = verify("tests.portability.dtensor_ops:chunked_model", nproc=2, timeout_s=240)
    assert result.plan.module_styles()["layers.0.attn.wq"] == "colwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


# --------------------------------------------------------------------------- expert banks


def test_expert_bank_with_biases_and_interleaving_is_recognised() -> None:
    ep = expert_params(Interleaved())
    assert ep is not None and ep.interleaved and ep.packed
    assert (ep.up, ep.down, ep.up_bias, ep.down_bias, ep.up_dim, ep.down_dim) == ("w_in", "w_out", "w_in_bias", "w_out_bias", 2, 1)
    odd = Interleaved()
    odd.extra = nn.Parameter(torch.zeros(4, 3))  # a 2-D parameter that is neither bias
    assert expert_params(odd) is None


SPLIT_BANKS = ("moe_tp_experts", "moe_whole_experts")  # the cost model picks; tiny banks take either


def _tiny_plan(model_type: str, tp: int = 2) -> tuple[nn.Module, shardplan.Plan]:
    pytest.importorskip("transformers")
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="meta")
    return model, shardplan.plan_model(model, {"tp": tp}, example_inputs=inputs, example_kwargs=kwargs, explain=False)


def test_gpt_oss_experts_split_with_their_biases() -> None:
    model, plan = _tiny_plan("gpt_oss")
    styles = plan.module_styles()
    assert all(styles[f"model.layers.{i}.mlp.experts"] in SPLIT_BANKS for i in range(2)), styles
    ep = expert_params(model.model.layers[0].mlp.experts)
    assert ep.interleaved and ep.up_bias == "gate_up_proj_bias" and ep.down_bias == "down_proj_bias"


def test_llama4_router_stays_whole_and_everything_else_splits() -> None:
    """Llama4Router subclasses nn.Linear and topk's and scatter_'s its own output inside its
    forward: the local check finds that, and only that module stays replicated."""
    _, plan = _tiny_plan("llama4_text")
    styles = plan.module_styles()
    assert styles["model.layers.0.feed_forward.router"] == "replicate"
    assert styles["model.layers.0.feed_forward.experts"] in SPLIT_BANKS
    assert {styles[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"} == {"colwise"}, styles
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    notes = [w for w in plan.warnings if "router" in w]
    assert len(notes) == 1 and "own forward fails on its shards" in notes[0] and "scatter_" in notes[0], plan.warnings


@pytest.mark.parametrize("style", SPLIT_BANKS)
@pytest.mark.parametrize("spec", ["tests.portability.experts:gpt_oss_with_biases", "hf-tiny:llama4_text",
                                  "tests.portability.experts:interleaved_moe"])
def test_frontier_experts_match_one_process_on_gloo(spec: str, style: str) -> None:
    """Outputs, loss and every gradient on 2 gloo ranks equal one process, the banks split
    either way. gpt-oss's expert biases are random here: inside every expert, a down bias
    added whole on every rank (not bias / tp), or interleaved gate/up halves cut as
    [gate; up], fails; whole experts per rank, a bias added for rows another rank runs fails."""
    if spec.startswith("hf") or "gpt_oss" in spec:
        pytest.importorskip("transformers")
    from shardplan.tools.sources import resolve_model

    if style == "moe_whole_experts" and "interleaved_moe" in spec:  # every token through every expert, summed
        with pytest.raises(shardplan.PlanningError, match="called with its routing"):
            shardplan.price_styles(interleaved_moe(), {"tp": 2}, {"experts": style}, example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
        return

    model, inputs, _ = resolve_model(spec, device="meta", batch_size=2, seq_len=16)
    banks = {re.sub(r"\.\d+\.", ".*.", n) for n, m in model.named_modules() if expert_params(m) is not None}
    plan = shardplan.price_styles(model, {"tp": 2}, {b: style for b in banks}, example_inputs=inputs)
    result = verify(spec, plan=plan, nproc=2, timeout_s=300, seq_len=16)
    assert style in set(result.plan.module_styles().values())
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert result.row("weights").max_abs == 0.0


def test_gpt_oss_attention_splits_by_heads_with_its_sinks() -> None:
    """gpt-oss's attention reads a per-head ``sinks`` parameter of its own, concatenated to
    the scores: sharded Shard(0) beside the heads, q/k/v are colwise and o_proj rowwise."""
    model, plan = _tiny_plan("gpt_oss")
    styles = plan.module_styles()
    assert {styles[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"} == {"colwise"}, styles
    assert styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    rule = next(r for r in plan.rules if r.param_layouts)
    assert rule.module == "model.layers.*.self_attn" and rule.param_layouts == {"sinks": "Shard(0)"}
    assert not [w for w in plan.warnings if "all-gathered" in w], plan.warnings


def test_param_layouts_round_trip_and_are_checked(tmp_path) -> None:
    from shardplan.plan.validate import check_findings

    model, plan = _tiny_plan("gpt_oss")
    path = tmp_path / "plan.yaml"
    plan.save(path)
    loaded = shardplan.load_plan(path)
    assert [r.param_layouts for r in loaded.rules] == [r.param_layouts for r in plan.rules]
    assert check_findings(loaded, model) == []
    rules = [r.model_copy(update={"param_layouts": {"sinkz": "Shard(0)"}}) if r.param_layouts else r for r in loaded.rules]
    findings = check_findings(loaded.model_copy(update={"rules": rules}), model)
    assert len(findings) == 1 and "'sinkz'" in findings[0] and "sinks" in findings[0], findings


def test_attention_is_split_along_its_leading_dims_never_its_sequence() -> None:
    """SDPA on ``[h, L, E]`` (mistral-inference's heads first, the batch flattened away) or
    ``[b, L, E]``: dim 0 only; on ``[b, h, L, E]`` dims 0 and 1. A split of L would attend
    within each rank's part of the sequence."""
    import torch.nn.functional as F
    from torch import nn

    from shardplan.analyze.graph import build_graph
    from shardplan.analyze.trace import trace_model
    from shardplan.decide.strategies import op_strategies

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            return F.scaled_dot_product_attention(q, q, q) + F.scaled_dot_product_attention(
                q.view(2, 8, 2, 8).transpose(1, 2), q.view(2, 8, 2, 8).transpose(1, 2), q.view(2, 8, 2, 8).transpose(1, 2)
            ).transpose(1, 2).reshape(2, 8, 16)

    graph = build_graph(trace_model(Attend(), (torch.zeros(2, 8, 16, device="meta"),)))
    sdpa = [op for op in graph.ops if op.target == "scaled_dot_product_attention"]
    outputs = [sorted({s.output for s in op_strategies(op, graph, tp=2)}) for op in sdpa]
    assert outputs == [["R", "S0"], ["R", "S0", "S1"]]
