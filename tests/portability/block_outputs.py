"""Blocks that hand the next block more than the hidden state, as T5 passes its relative
position bias: the first block computes a bias per head and every later block adds it to its
scores, so the bias is split by heads wherever the attention is. Also an optional mask passed
positionally as ``None`` before a tensor argument (``forward(ids, None, decoder_ids)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BiasedAttention(nn.Module):
    def __init__(self, dim: int, heads: int, *, buckets: int = 0) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim, bias=False)
        self.bias = nn.Embedding(buckets, heads) if buckets else None

    def position_bias(self, s: int) -> torch.Tensor:
        rel = torch.arange(s)[None, :] - torch.arange(s)[:, None]
        buckets = rel.clamp(0, self.bias.num_embeddings - 1)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, s, s]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, -1, self.hd).transpose(1, 2) for m in self.qkv)
        if bias is None:
            bias = self.position_bias(s)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, s, -1)), bias


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, *, buckets: int = 0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = BiasedAttention(dim, heads, buckets=buckets)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, bias = self.attn(self.norm1(x), bias)
        x = x + h
        return x + self.down(F.gelu(self.up(self.norm2(x)))), bias


class SharedBiasLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, buckets=8 if i == 0 else 0) for i in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        x, bias = self.embed(ids), None
        if mask is not None:  # a None passed positionally must stay None: a placeholder would be "not None"
            x = x * mask[..., None]
        for block in self.blocks:
            x, bias = block(x, bias)
        return self.head(x) * (1.0 if scale is None else scale)


def shared_bias_lm() -> SharedBiasLM:
    torch.manual_seed(0)
    return SharedBiasLM()


def shared_bias_lm_with_inputs() -> tuple[SharedBiasLM, tuple]:
    """The mask slot filled with None, a tensor after it."""
    return shared_bias_lm(), (torch.randint(0, 128, (2, 16)), None, torch.ones(()))


def t5_four_layers() -> tuple[nn.Module, tuple]:
    """Hugging Face's T5 at tiny widths with 4 blocks a side (3 folded into one kind), its
    inputs positional with the attention mask left None."""
    from shardplan.interop.hf_models import hf_build, hf_config, shrink_config, transformers_module

    tf = transformers_module()
    cfg = shrink_config(hf_config(tf, "t5", None))
    cfg.num_layers = cfg.num_decoder_layers = 4
    cfg.use_cache = False
    torch.manual_seed(0)
    model = hf_build(tf, cfg, "hf:t5", device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids, None, ids.flip(1))
