"""Built-in models: meta builds at scale, CPU forwards, determinism, tracing, and
head-sharded attention matching the unsharded result (what DTensor TP relies on)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.fx as fx
from torch import nn

from shardplan.models import (
    GPT2,
    MLP,
    PRESETS,
    GPT2Config,
    LlamaConfig,
    Transformer,
    build_preset,
    get_preset,
)
from shardplan.models.llama import ffn_hidden_dim

DEBUG_PRESETS = ["gpt2-debug", "llama3-debug", "llama3-small", "mlp", "parallel-debug"]
EXPECTED_NAMES = [
    "gpt2", "gpt2-debug", "llama3-405b", "llama3-70b", "llama3-8b",
    "llama3-debug", "llama3-small", "mlp", "parallel-debug",
]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def out_features(name: str) -> int:
    cfg = PRESETS[name].config
    return 128 if name == "mlp" else cfg.vocab_size


# --- registry -----------------------------------------------------------------


def test_preset_names_sorted() -> None:
    assert list(PRESETS) == EXPECTED_NAMES
    for name, preset in PRESETS.items():
        assert preset.name == name and preset.description


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ValueError) as exc:
        get_preset("llama4-1t")
    msg = str(exc.value)
    assert "'llama4-1t'" in msg and "package.module:callable" in msg
    for name in EXPECTED_NAMES:
        assert name in msg
    with pytest.raises(ValueError):
        build_preset("nope")


# --- meta builds --------------------------------------------------------------


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_every_preset_builds_on_meta(name: str) -> None:
    model = build_preset(name)
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    inputs = PRESETS[name].example_inputs(device="meta")
    assert isinstance(inputs, tuple) and all(t.is_meta for t in inputs)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("llama3-405b", 405e9), ("llama3-70b", 70.6e9), ("llama3-8b", 8.03e9), ("gpt2", 124e6)],
)
def test_big_preset_parameter_counts(name: str, expected: float) -> None:
    start = time.perf_counter()
    model = build_preset(name, device="meta")
    assert time.perf_counter() - start < 5.0
    assert abs(n_params(model) - expected) / expected < 0.02


def test_llama_ffn_hidden_sizes_match_released_models() -> None:
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert ffn_hidden_dim(16384, 4096, 1.2) == 53248
    model = build_preset("llama3-405b")
    assert model.layers[0].feed_forward.w1.weight.shape == (53248, 16384)
    assert model.layers[125].attention.wk.weight.shape == (8 * 128, 16384)


def test_meta_forward_of_8b_runs() -> None:
    model = build_preset("llama3-8b")
    (tokens,) = PRESETS["llama3-8b"].example_inputs(batch_size=1, seq_len=8, device="meta")
    assert model(tokens).shape == (1, 8, 128256)


# --- module layout ------------------------------------------------------------


def test_llama_fqns_are_torchtitan_names() -> None:
    names = {n for n, _ in build_preset("llama3-debug").named_parameters()}
    block = {
        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
        "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
        "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
    }
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{b}" for i in range(2) for b in block}
    assert names == expected
    model = build_preset("llama3-debug")
    assert isinstance(model.layers, nn.ModuleList)
    assert isinstance(model.norm, nn.RMSNorm)
    assert model.rope_cos.shape == (64, 8) and "rope_cos" not in model.state_dict()


def test_gpt2_lm_head_is_tied() -> None:
    for device in ("meta", "cpu"):
        model = build_preset("gpt2-debug", device=device)
        assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # deduplicated, reported once as wte
    assert model.h[0].attn.q_proj.bias is not None


def test_parallel_block_layout() -> None:
    model = build_preset("parallel-debug", device="cpu")
    block = model.h[0]
    assert not hasattr(block, "ln_2")
    assert model.lm_head.weight is not model.wte.weight
    x = torch.randn(2, 5, 64)
    h = block.ln_1(x)
    torch.testing.assert_close(block(x), x + (block.attn(h) + block.mlp(h)))


def test_mlp_layers() -> None:
    model = build_preset("mlp", device="cpu")
    assert [tuple(l.weight.shape) for l in model.layers] == [
        (512, 128), (128, 512), (512, 128), (128, 512)
    ]
    assert all(l.bias is not None for l in model.layers)
    assert MLP()(torch.randn(3, 64)).shape == (3, 64)


# --- CPU forwards and determinism ---------------------------------------------


@pytest.mark.parametrize("name", DEBUG_PRESETS)
def test_debug_forward_shape(name: str) -> None:
    model = build_preset(name, device="cpu")
    inputs = PRESETS[name].example_inputs()
    out = model(*inputs)
    batch = inputs[0].shape[0]
    expected = (batch, out_features(name)) if name == "mlp" else (batch, 16, out_features(name))
    assert out.shape == expected
    assert torch.isfinite(out).all()
    if name != "mlp":
        assert out.abs().max() < 50  # logits are O(1), not blown up by init


def test_example_inputs_are_fixed_and_in_range() -> None:
    preset = PRESETS["llama3-debug"]
    (a,), (b,) = preset.example_inputs(), preset.example_inputs()
    assert torch.equal(a, b) and a.dtype == torch.long and a.shape == (2, 16)
    assert 0 <= a.min() and a.max() < 512
    (c,) = preset.example_inputs(batch_size=3, seq_len=64)
    assert c.shape == (3, 64)
    with pytest.raises(ValueError):
        preset.example_inputs(seq_len=65)
    assert PRESETS["llama3-8b"].example_inputs(device="meta")[0].shape == (2, 2048)
    assert PRESETS["gpt2"].example_inputs(device="meta")[0].shape == (2, 1024)


def test_llama_deterministic_for_seed() -> None:
    (tokens,) = PRESETS["llama3-debug"].example_inputs()
    a = build_preset("llama3-debug", device="cpu", seed=7)(tokens)
    b = build_preset("llama3-debug", device="cpu", seed=7)(tokens)
    c = build_preset("llama3-debug", device="cpu", seed=8)(tokens)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_build_preserves_caller_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_preset("gpt2-debug", device="cpu", seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", DEBUG_PRESETS)
def test_meta_then_init_weights_matches_cpu_build(name: str) -> None:
    reference = build_preset(name, device="cpu", seed=3)
    model = build_preset(name, device="meta").to_empty(device="cpu")
    model.init_weights(3)
    ref_state, state = reference.state_dict(), model.state_dict()
    assert ref_state.keys() == state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], state[key]), key
    inputs = PRESETS[name].example_inputs()
    assert torch.equal(model(*inputs), reference(*inputs))
    if isinstance(model, GPT2):
        assert model.lm_head.weight is model.wte.weight


# --- tracing ------------------------------------------------------------------


@pytest.mark.parametrize("name", DEBUG_PRESETS)
def test_debug_models_export(name: str) -> None:
    model = build_preset(name, device="cpu").eval()
    inputs = PRESETS[name].example_inputs()
    exported = torch.export.export(model, inputs, strict=False)
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs))


@pytest.mark.parametrize("name", DEBUG_PRESETS)
def test_debug_models_symbolic_trace(name: str) -> None:
    # No value-dependent control flow, so even a plain symbolic trace works.
    model = build_preset(name, device="cpu")
    inputs = PRESETS[name].example_inputs()
    torch.testing.assert_close(fx.symbolic_trace(model)(*inputs), model(*inputs))


# --- head-sharded attention (what each tensor-parallel rank computes) ---------


def _rows(linear: nn.Linear, lo: int, hi: int, bias: bool) -> nn.Linear:
    out = nn.Linear(linear.in_features, hi - lo, bias=bias)
    out.weight.data = linear.weight.data[lo:hi].clone()
    if bias:
        out.bias.data = linear.bias.data[lo:hi].clone()
    return out


def _cols(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    out = nn.Linear(hi - lo, linear.out_features, bias=False)  # bias added once, outside
    out.weight.data = linear.weight.data[:, lo:hi].clone()
    return out


def _llama_rank(attn: nn.Module, rank: int, tp: int, cfg: LlamaConfig) -> nn.Module:
    local = copy.deepcopy(attn)
    q, kv = cfg.n_heads * cfg.head_dim // tp, cfg.n_kv_heads * cfg.head_dim // tp
    local.wq = _rows(attn.wq, rank * q, (rank + 1) * q, bias=False)
    local.wk = _rows(attn.wk, rank * kv, (rank + 1) * kv, bias=False)
    local.wv = _rows(attn.wv, rank * kv, (rank + 1) * kv, bias=False)
    local.wo = _cols(attn.wo, rank * q, (rank + 1) * q)
    return local


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_attention_head_sharded_matches_full(tp: int) -> None:
    model = build_preset("llama3-debug", device="cpu")
    cfg: LlamaConfig = model.config
    attn = model.layers[0].attention
    x = torch.randn(2, 10, cfg.dim)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    with torch.no_grad():
        full = attn(x, cos, sin)
        shards = sum(_llama_rank(attn, r, tp, cfg)(x, cos, sin) for r in range(tp))
    torch.testing.assert_close(shards, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_attention_head_sharded_matches_full(tp: int) -> None:
    model = build_preset("gpt2-debug", device="cpu")
    attn = model.h[0].attn
    width = model.config.n_embd // tp
    x = torch.randn(2, 10, model.config.n_embd)
    with torch.no_grad():
        full = attn(x)
        partial = torch.zeros_like(full)
        for r in range(tp):
            local = copy.deepcopy(attn)
            lo, hi = r * width, (r + 1) * width
            for proj in ("q_proj", "k_proj", "v_proj"):
                setattr(local, proj, _rows(getattr(attn, proj), lo, hi, bias=True))
            local.c_proj = _cols(attn.c_proj, lo, hi)
            partial += local(x)
    torch.testing.assert_close(partial + attn.c_proj.bias, full, rtol=1e-5, atol=1e-5)


def test_configs_reject_bad_head_counts() -> None:
    with pytest.raises(ValueError):
        LlamaConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=3, vocab_size=16)
    with pytest.raises(ValueError):
        GPT2Config(vocab_size=16, n_positions=8, n_embd=30, n_layer=1, n_head=4)
    assert isinstance(Transformer(LlamaConfig(64, 1, 4, 2, 32, max_seq_len=8)), nn.Module)
