"""Attention that reads a split tensor for its dtype or device only, as public code writes it.

* Diff-Transformer (microsoft/unilm ``multihead_diffattn.py``): the causal mask cast by
  ``.type_as(attn_weights)``, the lambdas (per-layer scalars from four parameters) by
  ``.type_as(q)``, heads paired by ``view(b, h, 2, t, s)``, a per-head RMSNorm.
* gpt-oss's reference attention: the mask made by ``q.new_full((T, T), -inf)``, one learned
  sink logit per head concatenated to the scores and dropped after the softmax.

q is split by heads; the mask and the lambdas are whole on every rank. Each builder gives a
2-layer LM over 256 tokens at dim 128.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class DiffAttention(nn.Module):
    def __init__(self, embed_dim: int, depth: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads // 2  # half of a Transformer's heads, each a pair
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.zeros(self.head_dim).normal_(0, 0.1)) for _ in range(4))
        self.subln = nn.RMSNorm(2 * self.head_dim, eps=1e-5)

    def forward(self, x):
        bsz, tgt_len, _ = x.size()
        q = self.q_proj(x).view(bsz, tgt_len, 2 * self.num_heads, self.head_dim).transpose(1, 2) * self.scaling
        k = self.k_proj(x).view(bsz, tgt_len, 2 * self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, tgt_len, self.num_heads, 2 * self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(-1, -2))
        attn_mask = torch.triu(torch.zeros([tgt_len, tgt_len]).float().fill_(float("-inf")).type_as(attn_weights), 1)
        attn_weights = torch.nan_to_num(attn_weights)
        attn_weights += attn_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float()).type_as(q)
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float()).type_as(q)
        lambda_full = lambda_1 - lambda_2 + self.lambda_init
        attn_weights = attn_weights.view(bsz, self.num_heads, 2, tgt_len, tgt_len)
        attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
        attn = self.subln(torch.matmul(attn_weights, v)) * (1 - self.lambda_init)
        return self.out_proj(attn.transpose(1, 2).reshape(bsz, tgt_len, self.num_heads * 2 * self.head_dim))


class SinkAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.sinks = nn.Parameter(torch.zeros(n_heads))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores + torch.triu(q.new_full((T, T), -float("inf")), diagonal=1)[None, None]
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, 1)
        w = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn = nn.RMSNorm(dim), nn.RMSNorm(dim), attn
        self.w1, self.w2 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, blocks: list[nn.Module], dim: int = 128, vocab: int = 256) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(vocab, dim), nn.ModuleList(blocks)
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def diff_attention() -> LM:
    torch.manual_seed(0)
    return LM([Block(DiffAttention(128, depth, 16), 128) for depth in range(2)])


def attention_sinks() -> LM:
    torch.manual_seed(0)
    return LM([Block(SinkAttention(128, 8), 128) for _ in range(2)])
