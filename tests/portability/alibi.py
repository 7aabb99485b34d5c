"""ALiBi made in the attention's own forward, the way MPT's, fairseq-ALiBi's and many research
repositories write it: the slopes come from the head count (computed on each call, or kept in a
non-persistent buffer), times the key-minus-query distances, added to scores split by heads.
No module receives the bias, so it must be cut inside the attention's code. The slopes of the
ALiBi paper (Press et al.), with the interpolation for head counts that are no power of two."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


def alibi_slopes(n_heads: int) -> torch.Tensor:
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_2(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor(power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest])


class MptAlibiAttention(nn.Module):
    """MPT's layout: one ``Wqkv``, ``chunk(3, dim=2)``, slopes from ``self.n_heads`` in forward,
    the bias masked causally and added to the ``matmul`` scores."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.Wqkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        q, k, v = self.Wqkv(x).chunk(3, dim=2)
        q, k, v = (t.view(B, S, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        slopes = alibi_slopes(self.n_heads).to(x.device)
        pos = torch.arange(S, device=x.device)
        bias = slopes[:, None, None] * (pos[None, :] - pos[:, None]).to(q.dtype)[None]  # [H, S, S]
        bias = bias.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + bias
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class BufferAlibiAttention(nn.Module):
    """Slopes kept in a non-persistent buffer; the bias passed to SDPA as ``attn_mask``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = (p(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        pos = torch.arange(S, device=x.device)
        bias = self.slopes.view(-1, 1, 1) * (pos[None, :] - pos[:, None]).to(q.dtype)
        bias = bias.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class AlibiBias(nn.Module):
    """A parameter-free module that makes the bias ``[1, H, S, S]`` for a sequence length."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads

    def forward(self, seq: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(seq, device=device)
        return (alibi_slopes(self.n_heads).to(device)[:, None, None] * (pos[None, :] - pos[:, None])).unsqueeze(0)


class SubmoduleAlibiAttention(nn.Module):
    """The bias from a child module of its own (x-transformers' ``AlibiPositionalBias``
    spelling), added to the scores before the causal mask; the output projection in an
    ``nn.Sequential`` with its dropout (lucidrains' spelling)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.heads = n_heads
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))
        self.rel_pos = AlibiBias(n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        sim = sim + self.rel_pos(n, x.device)
        sim = sim.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), -torch.finfo(sim.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def _lm(cls: type, dim: int = 96, heads: int = 6) -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([PreNormBlock(cls(dim, heads), dim) for _ in range(2)], dim=dim, vocab=128)


def mpt_alibi() -> TokenLM:
    return _lm(MptAlibiAttention)


def buffer_alibi() -> TokenLM:
    return _lm(BufferAlibiAttention)


def submodule_alibi() -> TokenLM:
    return _lm(SubmoduleAlibiAttention)
