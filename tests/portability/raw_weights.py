"""Attention whose weights are raw ``nn.Parameter``s its own code multiplies, the ways
research code and JAX ports write it: ``F.linear(x, self.wq)`` ([out, in], biases),
``x @ self.wq`` ([in, out]) with a hand-written causal softmax over a mask buffer and RoPE
made in forward, Flax's ``DenseGeneral`` as its own module (a kernel ``[D, H, hd]`` in an
``einsum``, the output kernel ``[H, hd, D]``), and GQA with complex RoPE, a per-head q/k norm
as raw weights, and a SwiGLU MLP on raw weights (``x @ self.w1.T``)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[-1]))


class LinearParams(nn.Module):
    """``F.linear`` on raw [out, in] weights, q and v with biases (a key bias has no gradient:
    softmax ignores what it adds to every key); views sized by the input. With ``kv_heads``,
    fewer k/v heads read by ``scaled_dot_product_attention(..., enable_gqa=True)``."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv = heads, kv_heads or heads
        kv_dim = self.n_kv * (dim // heads)
        self.wq, self.wk, self.wv, self.wo = _param(dim, dim), _param(kv_dim, dim), _param(kv_dim, dim), _param(dim, dim)
        self.bq, self.bv = nn.Parameter(torch.zeros(dim).uniform_(-0.1, 0.1)), nn.Parameter(torch.zeros(kv_dim).uniform_(-0.1, 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = F.linear(x, self.wq, self.bq).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = F.linear(x, self.wk).view(B, T, self.n_kv, -1).transpose(1, 2)
        v = F.linear(x, self.wv, self.bv).view(B, T, self.n_kv, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
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


class GQAComplexRope(nn.Module):
    """Fewer kv heads repeated by ``repeat_interleave``, complex RoPE from a buffer, ``x @ W.T``,
    and an RMS q/k norm per head written out with raw 1-D weights (whole: their gradients sum
    over the ranks' heads)."""

    def __init__(self, dim: int, heads: int, kv_heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = heads, kv_heads, dim // heads
        self.wq, self.wo = _param(dim, dim), _param(dim, dim)
        self.wk, self.wv = _param(kv_heads * self.head_dim, dim), _param(kv_heads * self.head_dim, dim)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(self.head_dim)), nn.Parameter(torch.ones(self.head_dim))
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _rope(self, t: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(z * self.freqs_cis[: t.shape[1]].view(1, t.shape[1], 1, -1)).flatten(3).type_as(t)

    @staticmethod
    def _rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self._rms((x @ self.wq.T).view(B, T, self.n_heads, self.head_dim), self.q_norm)
        k = self._rms((x @ self.wk.T).view(B, T, self.n_kv, self.head_dim), self.k_norm)
        v = (x @ self.wv.T).view(B, T, self.n_kv, self.head_dim)
        q, k = self._rope(q).transpose(1, 2), self._rope(k).transpose(1, 2)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.transpose(1, 2).repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C) @ self.wo.T


class QKNormModules(nn.Module):
    """Raw weights beside ``nn.RMSNorm`` children over each head (Qwen3's and OLMo's q/k norm
    as modules): the module is one op, its norms run inside its DTensor code."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (_param(dim, dim) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_norm(F.linear(x, self.wq).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(F.linear(x, self.wk).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        v = F.linear(x, self.wv).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(B, T, C), self.wo)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = _param(hidden, dim), _param(hidden, dim), _param(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w1.T) * (x @ self.w3.T)) @ self.w2.T


class RawBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = GQAComplexRope(dim, heads, kv_heads), SwiGLU(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def raw_llama(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return TokenLM([RawBlock(dim, heads) for _ in range(layers)], dim=dim, vocab=vocab)


def raw_mqa(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    """One kv head: k and v whole on every rank, each rank's query heads reading it."""
    return TokenLM([RawBlock(dim, heads, kv_heads=1) for _ in range(layers)], dim=dim, vocab=vocab)


class InlineRawBlock(nn.Module):
    """A whole pre-norm block in one forward on raw weights: layer norms written out with raw
    weights, attention, then an MLP whose first product reads the attention's summed output.
    Its code needs one all-reduce inside (before the residual and the second norm)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.ln1, self.ln2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.w_qkv_q, self.w_k, self.w_v, self.w_o = (_param(dim, dim) for _ in range(4))
        self.w_up, self.w_down = _param(4 * dim, dim), _param(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = F.layer_norm(x, (C,), self.ln1)
        q, k, v = (F.linear(h, w).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.w_qkv_q, self.w_k, self.w_v))
        x = x + F.linear(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C), self.w_o)
        return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (C,), self.ln2), self.w_up)), self.w_down)


def raw_blocks(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return TokenLM([InlineRawBlock(dim, heads) for _ in range(layers)], dim=dim, vocab=vocab)


def _lm(attn, *, dim: int, heads: int, layers: int, vocab: int) -> TokenLM:
    return TokenLM([PreNormBlock(attn(dim, heads), dim) for _ in range(layers)], dim=dim, vocab=vocab)


def linear_params(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(LinearParams, dim=dim, heads=heads, layers=layers, vocab=vocab)


def linear_params_gqa(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(lambda d, h: LinearParams(d, h, kv_heads=4), dim=dim, heads=heads, layers=layers, vocab=vocab)


def matmul_params(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(MatmulParams, dim=dim, heads=heads, layers=layers, vocab=vocab)


def qk_norm_modules(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(QKNormModules, dim=dim, heads=heads, layers=layers, vocab=vocab)


def dense_general(*, dim: int = 96, heads: int = 12, layers: int = 2, vocab: int = 128) -> TokenLM:
    return _lm(DenseGeneralAttention, dim=dim, heads=heads, layers=layers, vocab=vocab)
