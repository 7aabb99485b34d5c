"""ALiBi made in the attention's own forward (MPT, a buffer of slopes, a child module that makes
the bias): the whole bias is cut to each rank's heads where the attention's code reads it
(``R~S{d}``, a :class:`SliceFix` the local check finds), so q/k/v stay split by heads. Before,
the attention ran whole on every rank (q/k/v ``colwise_gather_output``)."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.plan.model import load_plan
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import alibi

SPLIT = {"mpt_alibi": (("Wqkv", "packed_colwise"), ("out_proj", "rowwise")),
         "buffer_alibi": (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise")),
         "submodule_alibi": (("to_qkv", "packed_colwise"), ("to_out.0", "rowwise"))}


def _plan(name: str, tp: int, seq: int = 16) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(alibi, name)()
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False)


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_alibi_made_inside_the_attention_keeps_it_split_by_heads(name: str, tp: int) -> None:
    """6 heads (slopes interpolated: no power of two) over 2 and 3 ranks; the slopes are cut,
    never made from a head count made local (that would run, on another model's slopes)."""
    plan = _plan(name, tp)
    styles = plan.module_styles()
    assert {(m, styles[f"layers.{i}.attn.{m}"]) for i in (0, 1) for m, _ in SPLIT[name]} == set(SPLIT[name]), plan.warnings
    assert not plan.warnings, plan.warnings
    # the attention's own head count is local where its code sizes views by it; the bias
    # module's (x-transformers') stays global, so the slopes are the model's, then cut
    local = {"submodule_alibi": [("layers.*.attn", {"heads": 6 // tp})]}.get(name, [])
    assert [(a.module, a.values) for a in plan.attributes] == local, plan.attributes
    [views] = plan.local_views
    assert views.module.startswith("layers.*.attn") and views.slices, views
    assert all(s.parts == tp for s in views.slices), views


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_alibi_made_inside_matches_one_process_on_gloo(name: str) -> None:
    result = verify(f"tests.portability.alibi:{name}", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
    assert result.plan.local_views and result.plan.local_views[0].slices


def test_alibi_made_inside_on_three_ranks_and_another_sequence_length() -> None:
    """Planned at 16 tokens, run at 24 on 3 gloo ranks (2 of the 6 heads each): the cut is by
    call, not by the shape seen when planning."""
    plan = _plan("mpt_alibi", 3)
    result = verify("tests.portability.alibi:mpt_alibi", plan=plan, nproc=3, seq_len=24, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_alibi_cut_costs_no_collective_and_round_trips_a_plan_file(tmp_path) -> None:
    model = alibi.buffer_alibi()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(tokens,), explain=False)
    plan.save(tmp_path / "plan.yaml")
    loaded = load_plan(tmp_path / "plan.yaml")
    assert loaded.local_views == plan.local_views
    counted = simulate(model, loaded, (tokens,))
    assert counted.matches, f"counted {dict(counted.counted)} != predicted {counted.predicted}"


def test_the_plan_format_doc_shows_this_plans_slices() -> None:
    """docs/plan-format.md's ``slices`` example is this plan's ``local_views``, as written."""
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).parent.parent / "docs" / "plan-format.md").read_text()
    block = re.search(r"MPT-style attention at tp=2 .*?```yaml\n(.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block)["local_views"] == _plan("mpt_alibi", 2).to_data()["local_views"]
