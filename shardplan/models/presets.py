"""Named built-in models: how to build each and what to feed it.

Contract:

* ``PRESETS`` maps a name to a frozen ``Preset``. ``Preset.build()`` constructs
  the model on the current default device (callers choose it with a
  ``torch.device`` context); ``Preset.example_inputs(*, batch_size=2,
  seq_len=None, device="cpu")`` returns the positional forward arguments as a
  tuple: token ids in ``[0, vocab)`` drawn from a fixed-seed generator (so
  identical across calls and ranks), or floats for the MLP. On ``"meta"`` the
  tensors are meta tensors of the same shape and dtype.
* ``build_preset(name, device="meta")`` is the safe default: meta construction
  allocates nothing, so even ``llama3-405b`` builds in well under a second.
  On a real device the RNG is seeded first, so one seed gives one set of
  weights. Building a big preset on a real device allocates it for real.
* Unknown names raise ``ValueError`` listing the valid names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .gpt2 import GPT2, GPT2Config, ParallelBlockModel
from .llama import LlamaConfig, Transformer
from .mlp import MLP

__all__ = ["PRESETS", "Preset", "build_preset", "get_preset"]

_INPUT_SEED = 1234  # fixed so every rank and every call sees the same batch
_DEBUG_SEQ_LEN = 16
_BIG_SEQ_LEN = 2048


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[..., tuple]
    config: Any = None  # the model's config object, for display; None for the MLP


def _token_inputs(vocab_size: int, max_seq_len: int, default_seq_len: int) -> Callable[..., tuple]:
    def example_inputs(
        *, batch_size: int = 2, seq_len: int | None = None, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor]:
        seq_len = default_seq_len if seq_len is None else seq_len
        _check_sizes(batch_size, seq_len, max_seq_len)
        device = torch.device(device)
        if device.type == "meta":
            return (torch.empty(batch_size, seq_len, dtype=torch.long, device=device),)
        gen = torch.Generator().manual_seed(_INPUT_SEED)
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
        return (tokens.to(device),)

    return example_inputs


def _float_inputs(in_features: int) -> Callable[..., tuple]:
    def example_inputs(
        *, batch_size: int = 2, seq_len: int | None = None, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor]:
        # seq_len is accepted (and ignored) so callers can treat presets uniformly.
        _check_sizes(batch_size, 1, 1)
        device = torch.device(device)
        if device.type == "meta":
            return (torch.empty(batch_size, in_features, device=device),)
        gen = torch.Generator().manual_seed(_INPUT_SEED)
        return (torch.randn(batch_size, in_features, generator=gen).to(device),)

    return example_inputs


def _check_sizes(batch_size: int, seq_len: int, max_seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 1 <= seq_len <= max_seq_len:
        raise ValueError(f"seq_len must be in [1, {max_seq_len}], got {seq_len}")


def _default_seq_len(max_seq_len: int, debug: bool) -> int:
    return min(max_seq_len, _DEBUG_SEQ_LEN if debug else _BIG_SEQ_LEN)


def _with_default_dtype(dtype: torch.dtype, build: Callable[[], nn.Module]) -> nn.Module:
    """Create parameters in ``dtype`` directly (a later ``.to`` costs time at 405B)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(previous)


def _llama(name: str, description: str, cfg: LlamaConfig, *, debug: bool) -> Preset:
    # the released Llama 3 weights are bfloat16; the debug shapes stay float32 for exact tests
    dtype = torch.float32 if debug else torch.bfloat16
    return Preset(
        name=name,
        description=description,
        # A fresh config per build: callers may mutate model.config freely.
        build=lambda: _with_default_dtype(dtype, lambda: Transformer(dataclasses.replace(cfg))),
        example_inputs=_token_inputs(
            cfg.vocab_size, cfg.max_seq_len, _default_seq_len(cfg.max_seq_len, debug)
        ),
        config=cfg,
    )


def _gpt(
    name: str, description: str, cls: type[nn.Module], cfg: GPT2Config, *, debug: bool
) -> Preset:
    return Preset(
        name=name,
        description=description,
        build=lambda: cls(dataclasses.replace(cfg)),
        example_inputs=_token_inputs(
            cfg.vocab_size, cfg.n_positions, _default_seq_len(cfg.n_positions, debug)
        ),
        config=cfg,
    )


def _mlp(name: str, description: str, dims: tuple[int, ...]) -> Preset:
    return Preset(
        name=name,
        description=description,
        build=lambda: MLP(dims),
        example_inputs=_float_inputs(dims[0]),
    )


_GPT2_DEBUG = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)

_ALL = [
    _gpt(
        "gpt2",
        "GPT-2 small (124M): 12 layers, 768 wide, 12 heads, tied LM head",
        GPT2,
        GPT2Config(vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
        debug=False,
    ),
    _gpt("gpt2-debug", "tiny GPT-2: 2 layers, 64 wide, 4 heads, tied LM head",
         GPT2, _GPT2_DEBUG, debug=True),
    _llama(
        "llama3-405b",
        "Llama 3 405B: 126 layers, 16384 wide, 128 heads / 8 kv heads",
        LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                    multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0),
        debug=False,
    ),
    _llama(
        "llama3-70b",
        "Llama 3 70B: 80 layers, 8192 wide, 64 heads / 8 kv heads",
        LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                    multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0),
        debug=False,
    ),
    _llama(
        "llama3-8b",
        "Llama 3 8B: 32 layers, 4096 wide, 32 heads / 8 kv heads",
        LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0),
        debug=False,
    ),
    _llama(
        "llama3-debug",
        "tiny Llama 3: 2 layers, 64 wide, 8 heads / 4 kv heads (GQA; tp<=4)",
        LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512,
                    multiple_of=32, max_seq_len=64),
        debug=True,
    ),
    _llama(
        "llama3-small",
        "small Llama 3: 4 layers, 256 wide, 8 heads / 8 kv heads (tp<=8)",
        LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=2048,
                    multiple_of=64, max_seq_len=256),
        debug=True,
    ),
    _mlp("mlp", "MLP 128-512-128-512-128: two up/down projection pairs",
         (128, 512, 128, 512, 128)),
    _gpt("parallel-debug",
         "tiny GPT-J-style model: attention and MLP in parallel off one LayerNorm",
         ParallelBlockModel, _GPT2_DEBUG, debug=True),
]

PRESETS: dict[str, Preset] = {p.name: p for p in sorted(_ALL, key=lambda p: p.name)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; expected one of: {', '.join(PRESETS)}; "
            "or give 'package.module:callable'"
        ) from None


def build_preset(
    name: str, *, device: str | torch.device = "meta", seed: int = 0
) -> nn.Module:
    """Build preset ``name`` on ``device``; on a real device the weights depend only on ``seed``.

    The caller's CPU RNG state is preserved. On an accelerator that device's
    RNG is seeded too (and left seeded)."""
    preset = get_preset(name)
    device = torch.device(device)
    if device.type == "meta":
        with torch.device(device):
            return preset.build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return preset.build()
