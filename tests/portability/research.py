"""Attention as research code writes it: widths read off the input (``B, T, C = x.size()``).

``NanoGPT`` follows nanoGPT's ``CausalSelfAttention`` (one packed ``c_attn``, ``split(self.n_embd)``,
``view(B, T, self.n_head, C // self.n_head)``, ``view(B, T, C)``); ``TimmViT`` follows timm's
``Attention`` (``qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)``, ``reshape(B, N, C)``).
Small sizes, so they run on CPU; ``nanogpt`` and ``vit`` build them for ``verify``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), attn, nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, n_head: int = 8, n_layer: int = 2, block_size: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(Block(CausalSelfAttention(dim, n_head), dim) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TimmViT(nn.Module):
    def __init__(self, dim: int = 64, num_heads: int = 8, depth: int = 2, num_classes: int = 16) -> None:
        super().__init__()
        self.patch = nn.Linear(48, dim)
        self.blocks = nn.ModuleList(Block(TimmAttention(dim, num_heads), dim) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, patches):
        x = self.patch(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


def nanogpt() -> nn.Module:
    return NanoGPT()


def vit() -> tuple[nn.Module, tuple]:
    return TimmViT(), (torch.randn(2, 16, 48),)
