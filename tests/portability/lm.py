"""The language model around the portability attentions: token ids in, logits out, through
pre-norm blocks (attention, then a two-Linear MLP). Only the attention differs between them."""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class PreNormBlock(nn.Module):
    def __init__(self, attn: nn.Module, dim: int, *, norm: Callable[[int], nn.Module] = nn.LayerNorm,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = attn
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(self.act(self.up(self.norm2(x))))


class TokenLM(nn.Module):
    def __init__(self, blocks: list[nn.Module], *, dim: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
