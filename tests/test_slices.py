"""A whole value read beside values split by heads (an ALiBi bias made from the mask) is cut
where its module receives it: ``PrepareModuleInput(Replicate -> Shard(d))``, no collective.
Plans on meta; collectives on the fake group; numerics on 2 gloo ranks (MPT's in
``tests/test_hf.py``, a hand-written one here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardplan
from shardplan.interop import hf
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify


class BiasedAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / self.hd ** 0.5 + bias  # bias: [heads, s, s]
        y = F.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class AlibiLM(nn.Module):
    """Per-head linear biases, made once from the positions (no gradient), passed to every layer."""

    def __init__(self, vocab: int = 128, dim: int = 512, heads: int = 8, depth: int = 3, learned: bool = False) -> None:
        super().__init__()
        self.embed, self.heads = nn.Embedding(vocab, dim), heads
        self.layers = nn.ModuleList(BiasedAttention(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)
        self.slopes = nn.Parameter(torch.rand(heads)) if learned else None

    def forward(self, tokens):
        s = tokens.shape[1]
        pos = torch.arange(s, device=tokens.device)
        slopes = self.slopes if self.slopes is not None else 2.0 ** -torch.arange(1, self.heads + 1, device=tokens.device)
        bias = slopes[:, None, None] * (pos[None, :] - pos[:, None]).float()[None]
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, bias)
        return self.head(h)


# wide enough that splitting the attention by heads beats the 2 ranks' other plans
TOKENS = (torch.zeros(2, 128, dtype=torch.long, device="meta"),)


def _plan(**kw) -> shardplan.Plan:
    with torch.device("meta"):
        model = AlibiLM(**kw)
    return shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS, explain=False)


def test_a_bias_made_from_positions_is_cut_where_attention_receives_it() -> None:
    plan = _plan()
    styles = plan.module_styles()
    assert (styles["layers.0.qkv"], styles["layers.0.o"]) == ("packed_colwise", "rowwise"), styles
    (region,) = [r for r in plan.regions if r.use_local_output and r.input != "output"]
    assert (region.module, region.input, region.desired_input_layouts) == ("layers.*", 1, "Shard(0)")  # layer(h, bias)
    assert not [w for w in plan.warnings if "gathered" in w], plan.warnings


def test_a_bias_with_a_gradient_is_not_sliced() -> None:
    """Learned slopes: a slice's gradient would come back in pieces, so none is offered (the
    slopes themselves are split by heads instead, as a per-head parameter of the model)."""
    plan = _plan(learned=True)
    assert not [r for r in plan.regions if r.use_local_output and r.input != "output"], plan.regions


def test_the_slice_costs_no_collective() -> None:
    torch.manual_seed(0)
    model, tokens = alibi_lm()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=tokens, explain=False)
    res = simulate(model, plan, tokens)
    assert res.matches, f"counted {dict(res.counted)} != predicted {res.predicted}"


def test_mpt_position_bias_is_cut_at_its_attention() -> None:
    model, inputs, _ = hf.build_hf_model("mpt", tiny=True, device="meta")  # (model, args, kwargs)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, explain=False)
    assert plan.module_styles()["transformer.blocks.0.attn.Wqkv"] == "packed_colwise"
    assert [(r.module, r.input, r.desired_input_layouts) for r in plan.regions if r.use_local_output and r.input != "output"] \
        == [("transformer.blocks.*.attn", "position_bias", "Shard(0)")]


def test_a_sliced_bias_matches_one_process_on_gloo() -> None:
    result = verify("tests.test_slices:alibi_lm", nproc=2, timeout_s=300)
    assert any(r.use_local_output and r.input == 1 for r in result.plan.regions), result.plan.regions
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def alibi_lm() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return AlibiLM(), (torch.randint(0, 128, (2, 128)),)
