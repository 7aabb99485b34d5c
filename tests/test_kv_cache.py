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
    (kv_cache.persistent_cache, {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
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


@pytest.mark.parametrize("name", ["buffer_cache", "attribute_cache", "module_cache", "returned_cache", "litgpt_cache",
                                  "persistent_cache", "gpt_fast_cache"])
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


def test_two_kv_heads_at_tp4_keep_the_cache_in_groups_and_attention_split_by_heads() -> None:
    """2 kv heads read by 8 query heads on 4 ranks: each rank holds the kv head its query heads
    read (``colwise_kv_*``, ``groups: 2``), and the cache keeps that head's keys, cut in 2
    chunks of which rank r holds chunk r // 2. Counted collectives equal the predicted ones."""
    plan = _plan(kv_cache.grouped_cache, 4)
    styles = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if k.startswith("layers.0.attention.")}
    assert (styles["wq"], styles["wo"]) == ("colwise", "rowwise") and not plan.warnings, (styles, plan.warnings)
    assert styles["wk"].startswith("colwise_kv_") and styles["wv"].startswith("colwise_kv_"), styles
    assert [(b.module, b.layouts, b.groups) for b in plan.buffers] == [
        ("layers.*.attention", {"cache_k": "Shard(2)", "cache_v": "Shard(2)"}, {"cache_k": 2, "cache_v": 2})]
    assert "  layers.*.attention: cache_k Shard(2) in 2 groups, cache_v Shard(2) in 2 groups" in plan_summary_lines(plan)
    again = Plan.from_yaml(plan.to_yaml())
    assert again.buffers == plan.buffers and check_findings(again, kv_cache.grouped_cache()) == []
    result = simulate(kv_cache.grouped_cache(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_one_kv_head_is_written_whole_into_a_whole_cache_with_the_query_heads_split() -> None:
    """Multi-query attention: every rank's query heads read the one kv head, so each rank
    holds its keys whole in a whole cache (as Megatron holds them) and the query and output
    projections split by heads; the key's gradient, a partial sum on each rank, is summed
    once by the k/v projection's style."""
    plan = _plan(kv_cache.mqa_cache, 2)
    styles = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if k.startswith("layers.0.attention.")}
    assert (styles["wq"], styles["wo"]) == ("colwise", "rowwise"), (styles, plan.warnings)
    assert not plan.buffers
    result = simulate(kv_cache.mqa_cache(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.parametrize(("name", "nproc"), [("grouped_cache", 4), ("mqa_cache", 2)])
def test_fewer_kv_heads_than_ranks_with_a_cache_match_one_process_on_gloo(name: str, nproc: int) -> None:
    result = verify(SPEC.format(name), nproc=nproc, timeout_s=300, seq_len=16)
    assert result.plan.module_styles()["layers.0.attention.wq"] == "colwise", result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    worst = run_on_gloo(workers.decode, world_size=nproc, args=(name, result.plan.to_yaml(), 16, 3), timeout_s=300)
    for rank in worst:
        assert len(rank) == 4 and max(rank) < 1e-5, worst


def test_torchtunes_cache_with_two_kv_heads_at_tp4_is_kept_in_groups() -> None:
    model = kv_cache.torchtune_grouped()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(torch.randint(0, 256, (2, 16)),), explain=False)
    styles = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if ".layers.0.attn." in k}
    assert (styles["q_proj"], styles["output_proj"]) == ("colwise", "rowwise") and not plan.warnings, (styles, plan.warnings)
    assert [b.groups for b in plan.buffers] == [{"k_cache": 2, "v_cache": 2}]
    worst = run_on_gloo(workers.prefill, world_size=4, args=("torchtune_grouped", plan.to_yaml(), 16), timeout_s=300)
    assert max(worst) < 1e-5, worst


def _gpt_fast_plan(tp: int, builder=kv_cache.gpt_fast_cache) -> Plan:
    with torch.device("meta"):
        model = builder()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_fasts_persistent_cache_is_split_by_kv_heads(tp: int) -> None:
    """gpt-fast registers its cache persistent (in the state dict): it is split as the keys
    written into it, and its fused wqkv of unequal parts split by heads."""
    plan = _gpt_fast_plan(tp)
    styles = {k.rpartition(".")[2]: v for k, v in plan.module_styles().items() if ".layers.0.attention." in k}
    assert styles == {"wqkv": "packed_colwise", "wo": "rowwise"} and not plan.warnings, (styles, plan.warnings)
    assert [(b.module, b.layouts) for b in plan.buffers] == [
        ("model.layers.*.attention.kv_cache", {"k_cache": "Shard(1)", "v_cache": "Shard(1)"})]
    assert check_findings(Plan.from_yaml(plan.to_yaml()), kv_cache.gpt_fast_cache()) == []
    result = simulate(kv_cache.gpt_fast_cache(), plan, (torch.randint(0, 256, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_persistent_cache_round_trips_through_dcp_at_another_tp_and_unsharded(tmp_path) -> None:
    """After a prefill on 2 ranks, the state dict holds each cache as one global DTensor:
    DCP saves it; 4 ranks and one plain process load it exactly, ``load_full_state_dict``
    too, and the next token decoded from the loaded cache at tp=4 equals one process's."""
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "ckpt")
    saved = run_on_gloo(workers.save_cache, world_size=2, args=(_gpt_fast_plan(2).to_yaml(), folder), timeout_s=300)[0]
    assert saved["split"] == [f"model.layers.{i}.attention.kv_cache.{n}" for i in (0, 1) for n in ("k_cache", "v_cache")]
    reference = kv_cache.gpt_fast_cache()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference(tokens)
    want = reference.state_dict()
    assert sorted(saved["full"]) == sorted(want)
    for key in want:  # computed split vs whole: equal to rounding
        torch.testing.assert_close(saved["full"][key], want[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    loaded = run_on_gloo(workers.load_cache, world_size=4, args=(_gpt_fast_plan(4).to_yaml(), folder, saved["full"]),
                         timeout_s=300)[0]
    plain = kv_cache.gpt_fast_cache()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=folder)  # no process group: DCP reads in this one process
    plain.load_state_dict(state)
    for name, got in (("DCP at tp=4", loaded["dcp"]), ("load_full_state_dict at tp=4", loaded["from_full"]),
                      ("DCP unsharded", plain.state_dict())):
        bad = [k for k in want if not torch.equal(got[k], saved["full"][k])]
        assert sorted(got) == sorted(want) and not bad, f"{name}: {bad[:3]} differ from what tp=2 saved"
    with torch.no_grad():
        logits = reference.model(tokens[:, :1], torch.tensor([16]))
    torch.testing.assert_close(loaded["logits"], logits, atol=1e-5, rtol=1e-5)


def test_a_persistent_cache_of_fewer_kv_heads_than_ranks_stays_whole_and_the_plan_says_why() -> None:
    """A state-dict entry is one DTensor, which cannot hold kv heads in groups: gpt-fast's
    cache of 2 kv heads at tp=4 stays whole, and the warning names the write and the fix."""
    plan = _gpt_fast_plan(4, kv_cache.gpt_fast_grouped)
    assert not plan.buffers
    said = [w for w in plan.warnings if w.startswith("model.layers.*.attention.kv_cache.k_cache: a persistent buffer")]
    assert len(said) == 1 and "k_out[:, :, input_pos] = k_val" in said[0], plan.warnings
    assert "fewer than tp=4" in said[0] and "persistent=False" in said[0]


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
    assert check_findings(again, kv_cache.persistent_cache()) == []  # its shard is saved as a DTensor
    odd = again.model_copy(update={"buffers": [again.buffers[0].model_copy(update={"layouts": {"cache_k": "Shard(0)"}})]})
    findings = check_findings(odd, kv_cache.CachedTransformer("buffer", max_batch=3))
    assert any("Shard(0) needs a dim of it that tp=2 divides" in f for f in findings), findings
    grouped = _plan(kv_cache.grouped_cache, 4)
    three = grouped.model_copy(update={"buffers": [grouped.buffers[0].model_copy(update={"groups": {"cache_k": 3}})]})
    findings = check_findings(three, kv_cache.grouped_cache())
    assert any("groups 3 does not divide tp=4" in f for f in findings), findings
    saved = kv_cache.CachedTransformer("persistent", n_kv_heads=2, max_batch=2)
    findings = check_findings(grouped, saved)
    assert any("a persistent buffer), whose entry cannot hold kv heads in groups" in f for f in findings), findings
    with pytest.raises(ValueError, match="groups names \\['cache_q'\\], which layouts does not split"):
        Plan.from_yaml(grouped.to_yaml().replace("cache_k: 2", "cache_q: 2"))


def test_the_plan_format_doc_shows_this_plans_buffers() -> None:
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).parent.parent / "docs" / "plan-format.md").read_text()
    block = re.search(r"From\s+`tests/portability/kv_cache.py` at tp=2:\s+```yaml\n(.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block)["buffers"] == _plan(kv_cache.buffer_cache, 2).to_data()["buffers"]
