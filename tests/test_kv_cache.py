"""A KV cache kept in the attention module and written in forward (Meta's reference Llama,
gpt-fast's cache module): the cache is split by kv heads with the keys written into it, so
attention stays split by heads. Models in ``tests/portability/kv_cache.py``."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.model import Plan
from shardplan.plan.validate import check_findings
from shardplan.tools.launch import run_on_gloo
from shardplan.tools.report import plan_summary_lines
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests import _kv_cache_workers as workers
from tests.portability import kv_cache

SPEC = "tests.portability.kv_cache:{}"
# builder, the attention's styles split by heads, the cache module, the cache's tensors
CASES = [
    (kv_cache.buffer_cache, {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
     "layers.*.attention", {"cache_k": "Shard(2)", "cache_v": "Shard(2)"}),
    (kv_cache.attribute_cache, {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
     "layers.*.attention", {"cache_k": "Shard(2)", "cache_v": "Shard(2)"}),
    (kv_cache.module_cache, {"wq": "colwise", "wkv": "packed_colwise", "wo": "rowwise"},
     "layers.*.attention.kv_cache", {"k_cache": "Shard(1)", "v_cache": "Shard(1)"}),
    (kv_cache.returned_cache, {"wq": "colwise", "wkv": "packed_colwise", "wo": "rowwise"},
     "layers.*.attention.kv_cache", {"k_cache": "Shard(1)", "v_cache": "Shard(1)"}),
    (kv_cache.litgpt_cache, {"attn": "colwise", "proj": "rowwise"}, "layers.*.attention.kv_cache",
     {"k": "Shard(1)", "v": "Shard(1)"}),
]


def _plan(builder, tp: int) -> Plan:
    with torch.device("meta"):
        model = builder()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("builder", "styles", "holder", "layouts"), CASES)
def test_the_cache_is_split_by_kv_heads_with_the_keys_written_into_it(builder, styles, holder, layouts, tp: int) -> None:
    plan = _plan(builder, tp)
    got = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if k.startswith("layers.0.attention.")}
    assert got == styles, plan.warnings
    assert [(b.module, b.layouts) for b in plan.buffers] == [(holder, layouts)]
    assert not plan.warnings, plan.warnings
    result = simulate(builder(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize("name", ["buffer_cache", "attribute_cache", "module_cache", "returned_cache", "litgpt_cache"])
def test_a_cached_attention_split_by_heads_matches_one_process_on_gloo(name: str) -> None:
    result = verify(SPEC.format(name), nproc=2, timeout_s=300, seq_len=16)
    assert result.plan.buffers, result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("name", ["buffer_cache", "attribute_cache", "returned_cache", "litgpt_cache"])
def test_generation_with_the_cache_split_by_heads_matches_one_process_on_gloo(name: str) -> None:
    """A prefill of 16 tokens, then 3 steps of one token each at the next cache position: each
    rank keeps its kv heads' keys in its cache shard between calls, and the logits of every
    call equal one process's."""
    plan = _plan(getattr(kv_cache, name), 2)
    assert plan.buffers and not plan.warnings, plan.warnings
    worst = run_on_gloo(workers.decode, world_size=2, args=(name, plan.to_yaml(), 16, 3), timeout_s=300)
    for rank in worst:
        assert len(rank) == 4 and max(rank) < 1e-5, worst


def test_torchtunes_cache_is_split_by_heads_and_generation_matches_one_process() -> None:
    """torchtune's Llama 3 set up for generation: its cache writes through a local name and
    returns it, and asserts on ``cache_pos[0]``, a value meta tensors lack (the check reads it
    as true and runs the block). Its head counts are made local, its caches split; a prefill's
    logits on 2 gloo ranks equal one process's."""
    model = kv_cache.torchtune_decoding()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.randint(0, 256, (2, 16)),), explain=False)
    styles = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if ".layers.0.attn." in k}
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "output_proj": "rowwise"}, plan.warnings
    assert [(b.module, b.layouts) for b in plan.buffers] == [
        ("decoder.layers.*.attn.kv_cache", {"k_cache": "Shard(1)", "v_cache": "Shard(1)"})]
    assert [a.values for a in plan.attributes] == [{"num_heads": 4, "num_kv_heads": 2}] and not plan.warnings
    worst = run_on_gloo(workers.prefill, world_size=2, args=("torchtune_decoding", plan.to_yaml(), 16), timeout_s=300)
    assert max(worst) < 1e-5, worst


def test_a_persistent_cache_stays_whole_and_the_plan_says_why() -> None:
    """A shard of a persistent buffer would be saved under the global name: it stays whole,
    the keys are gathered to be written into it, and the warning names the write and the fix."""
    plan = _plan(kv_cache.persistent_cache, 2)
    assert not plan.buffers
    assert plan.module_styles()["layers.0.attention.wk"] == "colwise_gather_output"
    said = [w for w in plan.warnings if w.startswith("layers.*.attention.cache_k: a persistent buffer written in forward")]
    assert len(said) == 1 and "cache_k[:bsz, start_pos: start_pos + seqlen] = xk" in said[0], plan.warnings
    assert "persistent=False" in said[0]


def test_a_cache_read_through_a_reference_the_trace_does_not_follow_stays_whole() -> None:
    """A plain tensor attribute written and read through a local name (``cache_k =
    self.cache_k; cache_k[...] = xk; keys = cache_k[...]``): no attribute lookup happens after
    the write, so the tracer reads the keys as a constant. Split, the cache would hand the
    attention one rank's heads where the plan holds all (before the trace followed buffers
    read this way, gpt-fast's shape computed wrong numbers on the ranks, with no warning): a
    cache the trace never reads back stays whole."""
    assert not _plan(kv_cache.alias_cache, 2).buffers
    result = verify(SPEC.format("alias_cache"), nproc=2, timeout_s=300, seq_len=16)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("name", ["buffer_cache", "attribute_cache", "module_cache"])
def test_planning_leaves_the_cache_as_it_was(name: str) -> None:
    model = getattr(kv_cache, name)()
    holder = model.layers[0].attention
    holder, key = (holder.kv_cache, "k_cache") if name == "module_cache" else (holder, "cache_k")
    before = {k: (t, t.clone()) for k, t in vars(holder).items() if isinstance(t, torch.Tensor)}
    before.update({k: (t, t.clone()) for k, t in holder._buffers.items()})
    shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.randint(0, 256, (2, 16)),), explain=False)
    now = {**{k: t for k, t in vars(holder).items() if isinstance(t, torch.Tensor)}, **holder._buffers}
    assert key in now and set(now) == set(before)
    for k, (tensor, values) in before.items():  # the write counter too: forward's add_ ran eagerly
        assert now[k] is tensor and type(tensor) is torch.Tensor and torch.equal(tensor, values), k


def test_a_plan_file_keeps_its_buffers_and_is_checked_against_the_model() -> None:
    plan = _plan(kv_cache.buffer_cache, 2)
    again = Plan.from_yaml(plan.to_yaml())
    assert again.buffers == plan.buffers
    assert "  layers.*.attention: cache_k Shard(2), cache_v Shard(2)" in plan_summary_lines(again)
    assert check_findings(again, kv_cache.buffer_cache()) == []
    findings = check_findings(again, kv_cache.persistent_cache())
    assert any("is in the state dict (a persistent buffer)" in f for f in findings), findings
    odd = again.model_copy(update={"buffers": [again.buffers[0].model_copy(update={"layouts": {"cache_k": "Shard(0)"}})]})
    findings = check_findings(odd, kv_cache.CachedTransformer("buffer", max_batch=3))
    assert any("Shard(0) needs a dim of it that tp=2 divides" in f for f in findings), findings


def test_the_plan_format_doc_shows_this_plans_buffers() -> None:
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).parent.parent / "docs" / "plan-format.md").read_text()
    block = re.search(r"From\s+`tests/portability/kv_cache.py` at tp=2:\s+```yaml\n(.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block)["buffers"] == _plan(kv_cache.buffer_cache, 2).to_data()["buffers"]
