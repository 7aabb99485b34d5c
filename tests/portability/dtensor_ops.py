"""Attention written with ops the hand rules do not know, as torchtitan and research code
write it: complex RoPE (``view_as_complex``/``view_as_real``), scores and output by
``einsum``, GQA by ``repeat_interleave``; one that writes its output chunk by chunk into a
zeros buffer (``out[:, :, i] = ...``, as the reference kernels of linear attention do:
Qwen3-Next's gated delta rule); and one that reshapes with literal global sizes."""

import torch
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


def rope_table(seq: int, head_dim: int) -> torch.Tensor:
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(seq, head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * table[None, :, None, :]).flatten(3).type_as(x)


class EinsumAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("table", rope_table(seq, self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, self.table[:s]), apply_rope(k, self.table[:s])
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim**0.5
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return self.wo(out.reshape(b, s, -1))


def EinsumModel(dim: int = 64, layers: int = 2, vocab: int = 128) -> TokenLM:
    return TokenLM([PreNormBlock(EinsumAttention(dim), dim) for _ in range(layers)], dim=dim, vocab=vocab)


class ChunkedAttention(nn.Module):
    """Causal attention computed one query chunk at a time, each chunk's result written into
    a buffer made by ``zeros_like``: ``out[:, :, i] = ...`` is an in-place ``setitem`` on a
    tensor split by heads (dim 1), along a dim no rank splits."""

    def __init__(self, dim: int = 64, heads: int = 8, chunk: int = 4) -> None:
        super().__init__()
        self.head_dim, self.chunk = dim // heads, chunk
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # [b, heads, chunks, chunk, head_dim]
        q, k, v = (w(x).view(b, s // self.chunk, self.chunk, -1, self.head_dim).permute(0, 3, 1, 2, 4)
                   for w in (self.wq, self.wk, self.wv))
        out = torch.zeros_like(v)
        for i in range(s // self.chunk):
            keys, values = k[:, :, : i + 1].flatten(2, 3), v[:, :, : i + 1].flatten(2, 3)
            scores = q[:, :, i] @ keys.transpose(-1, -2) / self.head_dim**0.5
            mask = torch.ones(self.chunk, (i + 1) * self.chunk, dtype=torch.bool, device=x.device).tril(i * self.chunk)
            out[:, :, i] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
        return self.wo(out.permute(0, 2, 3, 1, 4).reshape(b, s, -1))


def chunked_model() -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([PreNormBlock(ChunkedAttention(), 64) for _ in range(2)], dim=64, vocab=128)


class LiteralReshape(nn.Module):
    """``reshape(2, 16, 4, 16)``: global sizes written as numbers. DTensor reshapes a
    DTensor by its global shape, but between modules the code runs on local tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).reshape(2, 16, 4, 16).roll(1, dims=3)
        return self.down(h.flatten(2))


def einsum_model() -> EinsumModel:
    torch.manual_seed(0)
    return EinsumModel()
