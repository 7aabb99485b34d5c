"""A fused q/k/v projection with an elementwise op before its cut: OLMo v1's
``qkv.clamp_(min=-clip_qkv, max=clip_qkv)`` in place before ``split(fused_dims)`` (GQA: unequal
parts), DBRX's out-of-place ``qkv = qkv.clamp(...)`` before equal parts, and a scale before
``chunk``. The elementwise op runs block by block on the packed layout, so the projection is
``packed_colwise`` as without it."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM

DIM, HEADS, KV = 96, 6, 2


class OlmoAttention(nn.Module):
    def __init__(self, clip_qkv: float = 0.5) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.clip_qkv = HEADS, KV, clip_qkv
        hd = DIM // HEADS
        self.fused_dims = (DIM, KV * hd, KV * hd)
        self.att_proj = nn.Linear(DIM, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.att_proj(x)
        if self.clip_qkv is not None:
            qkv.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        B, T, C = q.size()
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, C // self.n_heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.attn_out(att.transpose(1, 2).contiguous().view(B, T, C))


class DbrxAttention(nn.Module):
    def __init__(self, clip_qkv: float = 0.5) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.clip_qkv = HEADS, DIM // HEADS, clip_qkv
        self.Wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.Wqkv(x)
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split([DIM, DIM, DIM], dim=2)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(att.transpose(1, 2).reshape(b, s, DIM))


class ScaledChunkAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = (self.qkv(x) * 0.5).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, s, c))


def _lm(cls: type) -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([PreNormBlock(cls(), DIM) for _ in range(2)], dim=DIM, vocab=128)


def olmo_clamp() -> TokenLM:
    return _lm(OlmoAttention)


def dbrx_clamp() -> TokenLM:
    return _lm(DbrxAttention)


def scaled_chunk() -> TokenLM:
    return _lm(ScaledChunkAttention)
