"""Attention written with ops the hand rules do not know, as torchtitan and research code
write it: complex RoPE (``view_as_complex``/``view_as_real``), scores and output by
``einsum``, GQA by ``repeat_interleave``; and one that reshapes with literal global sizes."""

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
