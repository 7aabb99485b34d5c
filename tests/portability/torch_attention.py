"""Attention written with torch's own ``nn.MultiheadAttention``, the way research code and
torch's transformer layers use it: inside a hand-written pre-norm block (batch first), in
``nn.TransformerEncoder`` (batch first and sequence first, causal mask), in
``nn.Transformer`` (decoder cross-attention on the encoder's output), and one call with a key
padding mask, ``add_bias_kv``, ``add_zero_attn`` and its averaged weights read downstream."""

import torch
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, *, need_weights: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.need_weights:  # the default call: weights computed, then dropped
            return self.mha(x, x, x)[0]
        return self.mha(x, x, x, need_weights=False)[0]


def pre_norm(heads: int = 8, dim: int = 64, *, need_weights: bool = False) -> TokenLM:
    return TokenLM([PreNormBlock(SelfAttention(dim, heads, need_weights=need_weights), dim) for _ in range(2)],
                   dim=dim, vocab=128)


def odd_heads() -> TokenLM:
    """6 heads: tp=4 does not divide them."""
    return pre_norm(heads=6, dim=48)


def default_weights() -> TokenLM:
    return pre_norm(need_weights=True)


class Encoder(nn.Module):
    def __init__(self, *, batch_first: bool = True, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=batch_first, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.batch_first = batch_first

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.batch_first else self.embed(tokens).transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(x if self.batch_first else x.transpose(0, 1))


def encoder() -> Encoder:
    torch.manual_seed(0)  # two builds are the same model (a training check compares them)
    return Encoder()


def encoder_seq_first() -> Encoder:
    return Encoder(batch_first=False)


class EncoderDecoder(nn.Module):
    """``nn.Transformer``: the decoder's ``multihead_attn`` reads the encoder's output."""

    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, 8, 1, 1, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.transformer(x[:, :8], x))


def encoder_decoder() -> EncoderDecoder:
    return EncoderDecoder()


class PaddedWithWeights(nn.Module):
    """Sequence first, a key padding mask, a learned key/value bias and a zero key; the
    averaged attention weights are read downstream."""

    def __init__(self, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 4, add_bias_kv=True, add_zero_attn=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1)
        y, weights = self.attn(x, x, x, key_padding_mask=tokens == 0)
        return self.head(y.transpose(0, 1) + weights[..., :1])  # weights: [batch, target, source]


def padded_with_weights() -> PaddedWithWeights:
    return PaddedWithWeights()
