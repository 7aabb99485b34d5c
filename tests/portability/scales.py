"""Learnable parameters a container reads in its own forward, beside heads split tp ways:
a per-head scale (split with the heads) and one scalar temperature (kept whole, its
gradient a sum over every head, so over every rank)."""

import torch
import torch.nn.functional as F
from torch import nn


class ScaledAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.hd = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, heads).view(1, heads, 1, 1))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) * self.head_scale * self.temperature
        y = F.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class ScaledLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = ScaledAttention(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.attn(x))


def scaled_lm() -> ScaledLM:
    torch.manual_seed(0)
    return ScaledLM()


class GatedLM(nn.Module):
    """A per-token gate from a Linear too narrow to split ([b, s, 1]) scaling a sharded
    activation: the gate's gradient on each rank would be a sum over its shard only."""

    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up, self.gate, self.down = nn.Linear(dim, 4 * dim), nn.Linear(dim, 1), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = F.gelu(self.up(x)) * torch.sigmoid(self.gate(x))
        return self.head(x + self.down(h))


def gated_lm() -> GatedLM:
    torch.manual_seed(0)
    return GatedLM()
