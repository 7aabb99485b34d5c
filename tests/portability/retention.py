"""A retention layer as RetNet implementations write it: per-head decay made from a buffer of
gammas, and the heads' outputs normalized by ``nn.GroupNorm(heads, dim)`` over
``[b * t, dim]`` (one group per head), gated by a swish of ``g_proj``."""

import torch
import torch.nn.functional as F
from torch import nn


class Retention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.g_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.group_norm = nn.GroupNorm(heads, dim, affine=False)
        self.register_buffer("decay", torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float))), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        index = torch.arange(t, device=x.device).float()
        distance = (index[:, None] - index[None, :]).masked_fill(index[:, None] < index[None, :], float("inf"))
        decay = torch.nan_to_num(torch.exp(distance * self.decay[:, None, None]))  # [heads, t, t]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
        v = self.v_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        out = ((q @ k.transpose(-1, -2)) * decay) @ v
        out = self.group_norm(out.transpose(1, 2).reshape(b * t, self.dim)).view(b, t, self.dim)
        return self.out_proj(F.silu(self.g_proj(x)) * out)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.retention = Retention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.retention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class RetNet(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def retnet() -> RetNet:
    torch.manual_seed(0)
    return RetNet()
