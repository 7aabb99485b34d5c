"""Attention whose weights are raw ``nn.Parameter``s its own code multiplies, the ways
research code and JAX ports write it: ``F.linear(x, self.wq)`` ([out, in], biases),
``x @ self.wq`` ([in, out]) with a hand-written causal softmax over a mask buffer and RoPE
made in forward, and Flax's ``DenseGeneral`` as its own module (a kernel ``[D, H, hd]`` in an
``einsum``, the output kernel ``[H, hd, D]``)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[-1]))


class LinearParams(nn.Module):
    """``F.linear`` on raw [out, in] weights, q and v with biases (a key bias has no gradient:
    softmax ignores what it adds to every key); views sized by the input."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.wq, self.wk, self.wv, self.wo = (_param(dim, dim) for _ in range(4))
        self.bq, self.bv = (nn.Parameter(torch.zeros(dim).uniform_(-0.1, 0.1)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = F.linear(x, self.wq, self.bq).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = F.linear(x, self.wk).view(B, T, self.n_heads, -1).transpose(1, 2)
        v = F.linear(x, self.wv, self.bv).view(B, T, self.n_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(B, T, C), self.wo)


class MatmulParams(nn.Module):
    """``x @ W`` on raw [in, out] weights, RoPE (rotate-half) made in forward, a causal mask
    buffer and softmax written out."""

    def __init__(self, dim: int, heads: int, max_len: int = 64) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv = (_param(dim, dim) for _ in range(3))
        self.wo = _param(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def _rope(self, t: torch.Tensor) -> torch.Tensor:
        T, half = t.shape[2], self.head_dim // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=t.device) / half))
        angles = torch.outer(torch.arange(T, dtype=torch.float32, device=t.device), freqs)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos + rotated * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = ((x @ w).view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = self._rope(q), self._rope(k)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C) @ self.wo


class DenseGeneral(nn.Module):
    """Flax's DenseGeneral: ``in_features`` dims contracted with the kernel's leading dims."""

    def __init__(self, spec: str, *shape: int) -> None:
        super().__init__()
        self.spec = spec
        self.kernel = _param(*shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum(self.spec, x, self.kernel)


class DenseGeneralAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        hd = dim // heads
        self.query, self.key, self.value = (DenseGeneral("btd,dhk->bthk", dim, heads, hd) for _ in range(3))
        self.out = DenseGeneral("bthk,hkd->btd", heads, hd, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (m(x).transpose(1, 2) for m in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2))


def _lm(attn, *, dim: int, heads: int, layers: int, vocab: int) -> TokenLM:
    return TokenLM([PreNormBlock(attn(dim, heads), dim) for _ in range(layers)], dim=dim, vocab=vocab)


def linear_params(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(LinearParams, dim=dim, heads=heads, layers=layers, vocab=vocab)


def matmul_params(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(MatmulParams, dim=dim, heads=heads, layers=layers, vocab=vocab)


def dense_general(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(DenseGeneralAttention, dim=dim, heads=heads, layers=layers, vocab=vocab)
