"""Attention called between or after a stack's blocks, from the model's own forward: a final
attention over the sequence, timm's attention pool (``AttentionPoolLatent``: a learned latent
query reading the tokens), and a Perceiver (learned latents that read the tokens, self-attend
in a stack, and are read back). Each reads its widths off its inputs (``B, N, C = x.shape``,
``reshape(B, N, C)``), so its shards need local sizes the check between the blocks finds;
the latents, a root parameter, reach colwise projections only."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock

DIM, HEADS, VOCAB = 64, 4, 128


class CrossAttention(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.h = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        M = context.shape[1]
        q = self.to_q(x).reshape(B, N, self.h, -1).permute(0, 2, 1, 3)
        k = self.to_k(context).reshape(B, M, self.h, -1).permute(0, 2, 1, 3)
        v = self.to_v(context).reshape(B, M, self.h, -1).permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(o.permute(0, 2, 1, 3).reshape(B, N, C))


class SelfAttention(CrossAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, x)


class AttentionPoolLatent(nn.Module):
    """timm's: a latent query ``[1, L, C]`` reads the tokens through a packed ``kv``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, latent_len: int = 1) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.latent_len = heads, dim // heads, latent_len
        self.latent = nn.Parameter(torch.randn(1, latent_len, dim) * 0.02)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, self.latent_len, C)).mean(1)


class BlocksThenAttention(nn.Module):
    """A stack, then one attention over its output from the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PreNormBlock(SelfAttention(), DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.final_attn = SelfAttention()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.head(h + self.final_attn(h))


class PooledClassifier(nn.Module):
    """A stack, then timm's attention pool to one vector per sequence, then the classes."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PreNormBlock(SelfAttention(), DIM) for _ in range(2))
        self.attn_pool = AttentionPoolLatent()
        self.head = nn.Linear(DIM, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.attn_pool(h))


class Perceiver(nn.Module):
    """Learned latents read the tokens, self-attend in a stack, and the tokens read them back."""

    def __init__(self, latents: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.latents = nn.Parameter(torch.randn(latents, DIM) * 0.02)
        self.cross = CrossAttention()
        self.cross_norm = nn.LayerNorm(DIM)
        self.blocks = nn.ModuleList(PreNormBlock(SelfAttention(), DIM) for _ in range(2))
        self.read = CrossAttention()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        lat = self.latents.unsqueeze(0).expand(tokens.shape[0], -1, -1)
        lat = lat + self.cross(lat, self.cross_norm(x))
        for block in self.blocks:
            lat = block(lat)
        return self.head(self.norm(x + self.read(x, lat)))


def blocks_then_attention() -> BlocksThenAttention:
    torch.manual_seed(0)
    return BlocksThenAttention()


def pooled_classifier() -> PooledClassifier:
    torch.manual_seed(0)
    return PooledClassifier()


def perceiver() -> Perceiver:
    torch.manual_seed(0)
    return Perceiver()
