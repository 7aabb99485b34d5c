"""Attention with fewer kv heads than tp, written the common ways: head counts kept as
integer attributes and GQA by ``repeat_interleave(self.n_rep)`` (research code), or
``scaled_dot_product_attention(..., enable_gqa=True)`` with no repeat at all."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


class AttributeGQA(nn.Module):
    """Views by ``self.n_heads`` / ``self.n_kv_heads`` and repeats by ``self.n_rep``: on a
    rank with one kv head and its share of the query heads, all three need local values."""

    def __init__(self, dim: int, heads: int, kv_heads: int, *, enable_gqa: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.n_rep = heads, kv_heads, heads // kv_heads
        self.head_dim = dim // heads
        self.enable_gqa = enable_gqa
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.enable_gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def FewKVModel(*, dim: int = 128, heads: int = 8, kv_heads: int = 2, layers: int = 2, vocab: int = 128,
               enable_gqa: bool = False) -> TokenLM:
    blocks = [PreNormBlock(AttributeGQA(dim, heads, kv_heads, enable_gqa=enable_gqa), dim) for _ in range(layers)]
    return TokenLM(blocks, dim=dim, vocab=vocab)


def attribute_gqa() -> TokenLM:
    """8 query heads, 2 kv heads: at tp=4 each kv head is on 2 ranks."""
    return FewKVModel()


def enable_gqa() -> TokenLM:
    return FewKVModel(enable_gqa=True)


def sixteen_heads() -> TokenLM:
    """16 query heads, 2 kv heads: kv heads on 4 ranks each at tp=8, on 8 at tp=16."""
    return FewKVModel(dim=256, heads=16, kv_heads=2)


class BroadcastMQA(nn.Module):
    """Falcon-7B's multi-query attention as research code writes it: k and v Linears one head
    wide, viewed ``[b, 1, s, hd]`` and broadcast to every query head by the matmuls themselves
    (no ``expand``, no ``repeat``)."""

    def __init__(self, dim: int = 96, heads: int = 6) -> None:
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.query = nn.Linear(dim, dim, bias=False)
        self.key, self.value = nn.Linear(dim, self.hd, bias=False), nn.Linear(dim, self.hd, bias=False)
        self.dense = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.key(x).view(B, 1, T, self.hd), self.value(x).view(B, 1, T, self.hd)
        att = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.dense((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def broadcast_mqa() -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([PreNormBlock(BroadcastMQA(), 96) for _ in range(2)], dim=96, vocab=128)
