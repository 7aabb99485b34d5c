"""Views that spell a width read off a whole tensor (plan ``local_views``): nanoGPT's and
timm's attention end with ``view(B, T, C)`` where ``C`` is the input's width, which no
attribute holds. The local check finds the fixes; plans on meta, numerics on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardplan
from shardplan.apply.localviews import install_local_views
from shardplan.plan.model import CutFix, LengthFix, LocalViews, PlanFileError, ViewFix
from shardplan.plan.validate import check_findings
from shardplan.tools.verify import verify
from tests.portability.research import NanoGPT, TimmViT

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def _plan(model_cls, tp: int, inputs) -> tuple[nn.Module, shardplan.Plan]:
    with torch.device("meta"):
        model = model_cls()
    return model, shardplan.plan_model(model, {"tp": tp}, example_inputs=inputs, explain=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt_attention_is_split_by_heads(tp: int) -> None:
    _, plan = _plan(NanoGPT, tp, TOKENS)
    styles = plan.module_styles()
    assert (styles["h.0.attn.c_attn"], styles["h.0.attn.c_proj"]) == ("packed_colwise", "rowwise"), styles
    assert plan.rule_for("h.0.attn.c_attn").packed == 3
    # q, k and v viewed by the global head count, and y by the input's width: heads / tp and C / tp;
    # split(self.n_embd, dim=2) of the packed c_attn: its width / tp
    assert [(v.module, v.fixes, v.cuts) for v in plan.local_views] == [
        ("h.*.attn", [ViewFix(dim=2, parts=tp)] * 4, [CutFix(call=0, parts=tp)])]
    assert not plan.attributes
    assert not [w for w in plan.warnings if "attn" in w], plan.warnings


def test_timm_attention_fixes_the_head_dim_of_its_packed_reshape() -> None:
    _, plan = _plan(TimmViT, 4, (torch.zeros(2, 16, 48, device="meta"),))
    styles = plan.module_styles()
    assert (styles["blocks.0.attn.qkv"], styles["blocks.0.attn.proj"]) == ("packed_colwise", "rowwise"), styles
    # reshape(B, N, 3, self.num_heads, self.head_dim): the heads (dim 3); reshape(B, N, C): the width
    assert [(v.module, v.fixes) for v in plan.local_views] == [
        ("blocks.*.attn", [ViewFix(dim=3, parts=4), ViewFix(dim=2, parts=4)])]


@pytest.mark.parametrize("spec", ["tests.portability.research:nanogpt", "tests.portability.research:vit"])
def test_local_views_match_one_process_on_gloo(spec: str) -> None:
    result = verify(spec, nproc=2, timeout_s=300)
    assert result.plan.local_views, result.plan.warnings
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


class _Views(nn.Module):
    def forward(self, x):
        b, t, c = 2, 4, 8  # the global sizes, as code that read them off a whole tensor has them
        fits = x.view(b, t, x.shape[-1])
        absorbed = x.view(b, -1, 2)
        return fits, absorbed, x.reshape(b, t, c)


def _views_plan(fixes: list[ViewFix]) -> shardplan.Plan:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8))
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 4, 8, device="meta"),), explain=False)
    return plan.model_copy(update={"local_views": [LocalViews(module="0", fixes=fixes)], "model": plan.model.model_copy(update={"repeats": {}})})


def test_only_views_that_hold_more_elements_than_their_tensor_are_fixed() -> None:
    holder = nn.Sequential(_Views())
    install_local_views(holder, _views_plan([ViewFix(dim=2, parts=2)]))
    fits, absorbed, fixed = holder(torch.zeros(2, 4, 4))  # one rank's half of 8 features
    assert fits.shape == (2, 4, 4) and absorbed.shape == (2, 8, 2) and fixed.shape == (2, 4, 4)


def test_the_mode_is_left_when_forward_raises() -> None:
    holder = nn.Sequential(_Views())
    install_local_views(holder, _views_plan([]))  # no fix for the failing reshape
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        holder(torch.zeros(2, 4, 4))
    assert torch._C._len_torch_function_stack() == depth


def test_local_views_round_trip_and_are_checked(tmp_path) -> None:
    model, plan = _plan(NanoGPT, 2, TOKENS)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    loaded = shardplan.load_plan(path)
    assert loaded.local_views == plan.local_views and check_findings(loaded, model) == []
    moved = loaded.model_copy(update={"local_views": [loaded.local_views[0].model_copy(update={"module": "h.*.attention"})]})
    (finding,) = check_findings(moved, model)
    assert "local_views h.*.attention: matches no module" in finding
    text = path.read_text().replace("parts: 2", "parts: 1", 1)
    with pytest.raises(PlanFileError, match="parts"):
        shardplan.Plan.from_yaml(text)


class _SequenceViews(nn.Module):
    """``x``: a gathered ``[b, s, c / 2]`` (whole sequence, half the heads); ``t``: the length
    the code read off its sequence shard (s / 2)."""

    def forward(self, x, t):
        b = x.shape[0]
        kept = x.view(b, 2 * t, x.shape[-1])
        heads = x.view(b, t, 4, 2)  # as many elements as x: it runs, on the wrong rows
        inferred = x.view(b, t, -1, 2)
        return kept, heads, inferred


def test_a_view_sized_by_a_length_read_off_a_sequence_shard_is_fixed_by_its_call() -> None:
    holder = nn.Sequential(_SequenceViews())
    fixes = [ViewFix(dim=2, parts=2, call=1, seq_dim=1, seq_parts=2), ViewFix(dim=2, parts=1, call=2, seq_dim=1, seq_parts=2)]
    plan = _views_plan(fixes)
    install_local_views(holder, plan)
    x = torch.arange(2 * 8 * 4.0).view(2, 8, 4)
    kept, heads, inferred = holder[0](x, 4)
    assert kept.shape == (2, 8, 4) and heads.shape == (2, 8, 2, 2) and inferred.shape == (2, 8, 2, 2)
    assert torch.equal(heads, x.view(2, 8, 2, 2)) and torch.equal(inferred, heads)
    data = plan.to_data()["local_views"][0]["fixes"]
    assert data[0] == {"dim": 2, "parts": 2, "call": 1, "seq_dim": 1, "seq_parts": 2}
    assert shardplan.Plan.from_yaml(plan.to_yaml()).local_views == plan.local_views
    plain = _views_plan([ViewFix(dim=2, parts=2)]).to_data()["local_views"][0]["fixes"]
    assert plain == [{"dim": 2, "parts": 2}]  # files without sequence fixes do not mention them
    with pytest.raises(ValueError, match="go together"):
        ViewFix(dim=2, parts=2, call=1)
    with pytest.raises(ValueError, match="at least 2"):
        ViewFix(dim=2, parts=1)


class _Lengths(nn.Module):
    """``t``: a length read off a sequence shard; the code makes a mask from it and cuts a
    whole table by it."""

    def forward(self, table, t):
        mask = torch.ones(t, t).tril()
        positions = torch.arange(t)
        return mask, positions, table[:, :t, :t]


def test_factories_and_cuts_by_a_length_read_off_a_sequence_shard_get_the_whole_length() -> None:
    holder = nn.Sequential(_Lengths())
    plan = _views_plan([])
    entry = LocalViews(module="0", cuts=[CutFix(call=0, parts=1, seq_parts=2)],
                       lengths=[LengthFix(function="ones", call=0, args=[0, 1], parts=2),
                                LengthFix(function="arange", call=0, args=[0], parts=2)])
    install_local_views(holder, plan.model_copy(update={"local_views": [entry]}))
    mask, positions, cut = holder[0](torch.zeros(1, 8, 8), 4)
    assert mask.shape == (8, 8) and torch.equal(positions, torch.arange(8)) and cut.shape == (1, 8, 8)
    data = plan.model_copy(update={"local_views": [entry]}).to_data()["local_views"][0]
    assert data["cuts"] == [{"call": 0, "parts": 1, "seq_parts": 2}]
    assert shardplan.Plan.from_yaml(plan.model_copy(update={"local_views": [entry]}).to_yaml()).local_views == [entry]
    with pytest.raises(ValueError, match="divides by parts >= 2 or multiplies"):
        CutFix(call=0, parts=1)
