"""torch's ``nn.MultiheadAttention`` split by heads (``attention_heads``): its local
computation equals torch's on every option (masks, key/value bias, zero attention, weights,
unbatched inputs); plans at tp=2 and 4 for the ways code uses it (a hand-written block,
``nn.TransformerEncoder`` batch first and sequence first, ``nn.Transformer``'s cross-attention,
a padded call whose weights are read); the whole attention, with the reason, where tp does
not divide the heads or per-head weights are asked for; counted collectives equal the
predicted ones on the fake process group, sequence parallel included; and numerics on 2
gloo ranks against one process."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import shardplan
from shardplan.apply.attention_style import local_attention, mha_arguments
from shardplan.tools.simulate import simulate
from shardplan.tools.verify import verify
from tests.portability import conv_first, torch_attention

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
SPLIT = {  # model -> its nn.MultiheadAttention modules (first block) and its MLP Linears
    "pre_norm": (["layers.*.attn.mha"], ["layers.*.up", "layers.*.down"]),
    "encoder": (["encoder.layers.*.self_attn"], ["encoder.layers.*.linear1", "encoder.layers.*.linear2"]),
    "encoder_seq_first": (["encoder.layers.*.self_attn"], ["encoder.layers.*.linear1", "encoder.layers.*.linear2"]),
    "encoder_decoder": (["transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                         "transformer.decoder.layers.0.multihead_attn"],
                        ["transformer.decoder.layers.0.linear1", "transformer.decoder.layers.0.linear2"]),
    "padded_with_weights": (["attn"], []),
}


def _plan(name: str, tp: int, **options) -> shardplan.Plan:
    with torch.device("meta"):
        model = getattr(torch_attention, name)()
    return shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS, **options)


def _options() -> list[tuple]:
    grid = itertools.product([True, False], [False, True], [False, True], [None, 8], [True, False],
                             [None, "2d", "3d"], [False, True], [False, True])
    return [o for o in grid if not (o[-1] and o[5] == "3d")]  # is_causal goes with a 2-D mask


@pytest.mark.parametrize(("batch_first", "bias_kv", "zero_attn", "kdim", "need_weights", "mask", "padding", "causal"),
                         _options())
def test_local_attention_is_torchs_on_one_rank(batch_first, bias_kv, zero_attn, kdim, need_weights, mask, padding,
                                               causal) -> None:
    """At tp=1 the rank's heads are all heads: the local computation (plus the out bias the
    style adds after the sum) must give torch's output and weights."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=batch_first, add_bias_kv=bias_kv, add_zero_attn=zero_attn,
                              kdim=kdim, vdim=kdim).eval()
    q = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    k = torch.randn(*q.shape[:2], kdim or 16)
    kwargs = {"need_weights": need_weights, "is_causal": causal,
              "attn_mask": {None: None, "2d": torch.triu(torch.ones(5, 5, dtype=torch.bool), 1),
                            "3d": torch.randn(12, 5, 5)}[mask if not causal else "2d"],
              "key_padding_mask": (torch.arange(5) == 4).expand(3, 5) if padding else None}
    want = m(q, k, k.clone(), **kwargs)
    out, weights = local_attention(m, tp=1, rank=0, **mha_arguments((q, k, k.clone()), kwargs))
    torch.testing.assert_close(out + m.out_proj.bias, want[0])
    if need_weights:
        torch.testing.assert_close(weights, want[1])
    else:
        assert weights is None


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_multihead_attention_is_split_by_heads(name: str, tp: int) -> None:
    plan = _plan(name, tp)
    attention, (up, down) = SPLIT[name][0], SPLIT[name][1] or (None, None)
    styles = {r.module: r.style for r in plan.rules}
    assert all(styles[a] == "attention_heads" for a in attention), styles
    assert up is None or (styles[up], styles[down]) == ("colwise", "rowwise"), styles
    # out_proj is part of the attention's call: no rule of its own
    assert not any(r.module.endswith("out_proj") for r in plan.rules), styles
    assert not plan.warnings, plan.warnings
    assert plan.estimate.param_bytes_per_device < 0.6 * plan.model.num_params * 4


def test_heads_tp_does_not_divide_run_whole_with_the_reason() -> None:
    plan = _plan("odd_heads", 4)
    assert plan.rule_for("layers.0.attn.mha").style == "replicate"
    assert plan.warnings == ["layers.*.attn.mha: its 6 heads do not divide by tp=4, so the attention runs whole; "
                             "use a tp that divides them"]


def test_weights_nobody_reads_are_named_with_the_call() -> None:
    plan = _plan("default_weights", 2)
    assert plan.rule_for("layers.0.attn.mha").style == "attention_heads"
    (warning,) = plan.warnings
    assert warning.startswith("layers.*.attn.mha: the call (tests/portability/torch_attention.py:21 `return self.mha(x, x, x)[0]`)"), warning
    assert "nothing reads, and each call all-reduces them (2x16x16); pass need_weights=False" in warning, warning
    fewer = _plan("pre_norm", 2)
    assert fewer.estimate.collectives["forward"].all_reduce == plan.estimate.collectives["forward"].all_reduce - 2


def test_per_head_weights_run_whole() -> None:
    class PerHead(torch_attention.SelfAttention):
        def forward(self, x):
            return self.mha(x, x, x, average_attn_weights=False)[0]

    with torch.device("meta"):
        model = torch_attention.pre_norm()
        for layer in model.layers:
            layer.attn = PerHead(64, 8)
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS)
    assert plan.rule_for("layers.0.attn.mha").style == "replicate"
    assert "per-head attention weights (average_attn_weights=False)" in plan.warnings[0], plan.warnings


def test_check_refuses_heads_tp_does_not_divide() -> None:
    """A plan made at tp=2 for 6 heads, edited to tp=4: ``shardplan check`` says why."""
    from shardplan.plan.validate import check_findings

    plan = _plan("odd_heads", 2)
    assert plan.rule_for("layers.0.attn.mha").style == "attention_heads"
    edited = plan.model_copy(update={"mesh": plan.mesh.model_copy(update={"axes": {"tp": 4}})})
    with torch.device("meta"):
        findings = check_findings(edited, torch_attention.odd_heads())
    assert any("attention_heads splits its 6 heads, which tp=4 does not divide" in f for f in findings), findings


@pytest.mark.parametrize(("name", "sp"), [("encoder", False), ("encoder_seq_first", False), ("encoder_decoder", False),
                                          ("padded_with_weights", False), ("encoder", True), ("pre_norm", True)])
def test_simulated_collectives_equal_the_prediction(name: str, sp: bool) -> None:
    """Per attention: one all-reduce (or, under sequence parallel, an all-gather in and a
    reduce-scatter out) forward, the inputs' gradients summed once per distinct input
    backward, averaged weights summed by one more all-reduce; bytes too."""
    plan = _plan(name, 4, sequence_parallel=True if sp else None)
    if sp:
        assert plan.rule_for("encoder.layers.0.norm1" if name == "encoder" else "layers.0.norm1").style == "sequence_parallel"
    result = simulate(getattr(torch_attention, name)(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    for phase in ("forward", "backward"):
        assert result.counted_bytes[phase] == plan.estimate.collective_bytes[phase], phase


@pytest.mark.parametrize(("name", "options"), [("encoder", {}), ("encoder_decoder", {}), ("padded_with_weights", {}),
                                               ("pre_norm", {"sequence_parallel": True})])
def test_split_attention_matches_one_process_on_gloo(name: str, options: dict) -> None:
    result = verify(f"tests.portability.torch_attention:{name}", nproc=2, seq_len=16, timeout_s=300, **options)
    assert "attention_heads" in {r.style for r in result.plan.rules}
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("name", ["encoder", "pre_norm"])
def test_under_fsdp_the_counted_collectives_and_bytes_equal_the_prediction(name: str) -> None:
    """dp=2 x tp=2: out_proj's parameters are the attention's (counted once per FSDP unit)."""
    with torch.device("meta"):
        model = getattr(torch_attention, name)()
    plan = shardplan.plan_model(model, {"dp": 2, "tp": 2}, example_inputs=TOKENS)
    result = simulate(getattr(torch_attention, name)(), plan, (torch.randint(0, 128, (2, 16)),), fsdp=True)
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert result.counted_bytes == plan.estimate.collective_bytes


def test_an_encoder_trains_under_fsdp_as_one_process() -> None:
    """dp=2 x tp=2 on 4 gloo ranks: the losses and clipped gradient norms of two AdamW steps
    equal one process on the whole batch (the second loss reads the first step's weights).
    The final weights are not compared: reading a packed weight back whole under FSDP2 (its
    ``_StridedShard`` on tp under FSDP's own on dp) is the layout docs/training.md lists as
    not covered."""
    from shardplan.tools.launch import run_on_gloo
    from tests import _fsdp_workers as workers
    from tests.test_numerics import TOLS

    axes = {"dp": 2, "tp": 2}
    with torch.device("meta"):
        model = torch_attention.encoder()
    plan = shardplan.plan_model(model, axes, example_inputs=TOKENS, explain=False)
    assert plan.module_styles()["encoder.layers.0.self_attn"] == "attention_heads"
    atol, rtol = TOLS["param"]
    results = run_on_gloo(workers.train, world_size=4, timeout_s=300, args=(
        plan.to_yaml(), axes, 4, 2, 1.0, atol, rtol, "tests.portability.torch_attention:encoder"))
    for r in results:
        for ref, got in r["losses"] + r["norms"]:
            assert abs(got - ref) <= TOLS["loss"][0], (r["losses"], r["norms"])


@pytest.mark.parametrize(("name", "says"), [("vit", "it starts with a Conv2d (3 channels)"),
                                            ("two_inputs", "forward() takes 2 inputs (source, target)")])
def test_inputs_that_cannot_be_inferred_are_asked_for(name: str, says: str) -> None:
    from shardplan.cli import main

    with pytest.raises(ValueError, match="cannot infer example inputs") as info:
        shardplan.plan_model(getattr(conv_first, name)(), {"tp": 2})
    assert says in str(info.value) and "return (model, example_inputs) from the callable" in str(info.value)
    assert main(["plan", f"tests.portability.conv_first:{name}", "--mesh", "tp=2"]) == 2


@pytest.mark.parametrize("name", ["vit_with_inputs", "two_inputs_with_inputs"])
def test_a_callable_hands_its_example_inputs_to_every_command(name: str) -> None:
    """``(model, example_inputs)`` from the callable: planned, simulated and verified with them."""
    from shardplan.cli import main

    spec = f"tests.portability.conv_first:{name}"
    assert main(["plan", spec, "--mesh", "tp=2"]) == 0
    assert main(["simulate", spec, "--mesh", "tp=2"]) == 0
    result = verify(spec, nproc=2, timeout_s=300)
    assert "attention_heads" in {r.style for r in result.plan.rules}
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)
