"""Multi-head latent attention written as torchtitan's DeepSeek-V3 writes it: one shared
rotary key per token, ``k_pe.expand(-1, -1, self.n_heads, -1)`` to every head, beside
per-head keys and values decompressed from a low-rank latent."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


class LatentAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, rank: int = 32, nope: int = 16, rope: int = 8, v: int = 16) -> None:
        super().__init__()
        self.n_heads, self.rank, self.nope, self.rope, self.v = heads, rank, nope, rope, v
        self.wq = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, rank + rope, bias=False)
        self.kv_norm = nn.RMSNorm(rank)
        self.wkv_b = nn.Linear(rank, heads * (nope + v), bias=False)
        self.wo = nn.Linear(heads * v, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        k_pe = torch.tanh(k_pe).unsqueeze(2)  # stands in for RoPE: any op on the shared key
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, -1, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def LatentModel(dim: int = 64, layers: int = 2, vocab: int = 128) -> TokenLM:
    blocks = [PreNormBlock(LatentAttention(dim), dim, norm=nn.RMSNorm, act=F.silu) for _ in range(layers)]
    return TokenLM(blocks, dim=dim, vocab=vocab)


def latent_model() -> TokenLM:
    return LatentModel()
