"""Attention that folds the heads into the batch for ``torch.bmm``, as fairseq, OPT's and
BLOOM's early code and Megatron's legacy core attention write it: ``[b, s, h * d]`` viewed to
``[b * h, s, d]``, scores by ``bmm`` (or ``baddbmm`` with ``beta=0``), softmax, ``bmm`` with
the values, and viewed back by the head count. Sizes are integer attributes, as such code
keeps them; the sequence length is read from the input."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


class BmmAttention(nn.Module):
    """fairseq/OPT: ``[b, s, h * d] -> [b, h, s, d] -> [b * h, s, d]``, a causal mask built
    on the input's device."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.embed_dim = heads, dim // heads, dim
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def _fold(self, t: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
        t = t.view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        return t.reshape(bsz * self.num_heads, seq, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self._fold(self.q_proj(x) * self.scaling, bsz, seq)
        k, v = self._fold(self.k_proj(x), bsz, seq), self._fold(self.v_proj(x), bsz, seq)
        scores = torch.bmm(q, k.transpose(1, 2))
        mask = torch.full((seq, seq), float("-inf"), device=x.device).triu(1)
        attn = torch.bmm(F.softmax(scores + mask, dim=-1), v)
        attn = attn.view(bsz, self.num_heads, seq, self.head_dim).transpose(1, 2)
        return self.out_proj(attn.reshape(bsz, seq, self.embed_dim))


class MegatronCoreAttention(nn.Module):
    """Megatron's legacy layout: sequence first, ``[s, b, np * hn] -> [s, b * np, hn]``,
    scores by ``baddbmm`` into an empty buffer with ``beta=0``, viewed to ``[b, np, s, s]``
    for the mask and softmax and back, and the context permuted to ``[s, b, np * hn]``."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.num_attention_heads, self.hidden_size_per_attention_head = heads, dim // heads
        self.hidden_size = dim
        self.query_key_value = nn.Linear(dim, 3 * dim)  # grouped per head: [q_i, k_i, v_i] for each head i
        self.dense = nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.transpose(0, 1)  # [s, b, h]
        sq, b, _ = x.shape
        np_, hn = self.num_attention_heads, self.hidden_size_per_attention_head
        mixed = self.query_key_value(x).view(sq, b, np_, 3 * hn)
        q, k, v = torch.split(mixed, hn, dim=3)
        q, k = q.reshape(sq, b * np_, hn), k.reshape(sq, b * np_, hn)
        buffer = torch.empty(b * np_, sq, sq, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(buffer, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=1.0 / math.sqrt(hn))
        scores = scores.view(b, np_, sq, sq)
        causal = torch.ones(sq, sq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        context = torch.bmm(probs.view(b * np_, sq, sq), v.reshape(sq, b * np_, hn).transpose(0, 1))
        context = context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size)
        return self.dense(context).transpose(0, 1)


class FairseqAttention(nn.Module):
    """fairseq's ``MultiheadAttention``: time-major ``[t, b, c]``, q scaled before the fold,
    the keys and values folded by ``view(-1, bsz * self.num_heads, self.head_dim)`` (a ``-1``
    where the local count must go), the mask added to the ``bmm`` scores."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = dim, heads, dim // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = x.transpose(0, 1)
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        mask = torch.triu(torch.full((tgt_len, tgt_len), float("-inf"), device=x.device), 1)
        attn_probs = F.softmax(attn_weights + mask.unsqueeze(0), dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn).transpose(0, 1)


class ExpandedMaskAttention(nn.Module):
    """A whole causal mask expanded to every folded row, ``mask.expand(b * self.n_heads, s,
    s)``, as the ``baddbmm`` input with ``beta=1``; a packed ``[q_i, k_i, v_i]`` per head."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, dim // heads
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.n_heads, 3 * self.head_dim)
        q, k, v = (t.permute(0, 2, 1, 3).reshape(-1, s, self.head_dim) for t in torch.split(qkv, self.head_dim, dim=-1))
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        scores = torch.baddbmm(mask.expand(b * self.n_heads, s, s), q, k.transpose(1, 2),
                               beta=1.0, alpha=1.0 / math.sqrt(self.head_dim))
        ctx = torch.bmm(scores.softmax(-1), v)
        return self.dense(ctx.view(b, -1, s, self.head_dim).permute(0, 2, 1, 3).reshape(b, s, -1))


def _lm(cls) -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([PreNormBlock(cls(), 64) for _ in range(2)], dim=64, vocab=128)


def bmm_model() -> TokenLM:
    return _lm(BmmAttention)


def megatron_model() -> TokenLM:
    return _lm(MegatronCoreAttention)


def expanded_mask_model() -> TokenLM:
    return _lm(ExpandedMaskAttention)


def fairseq_model() -> TokenLM:
    return _lm(FairseqAttention)


class FairseqSelfAttention(FairseqAttention):
    """fairseq's attention as its layers call it: time-major in and out, ``query``, ``key``
    and ``value`` passed by keyword (the same tensor), the mask as an argument, and the
    softmax taken in float and cast back with ``type_as``."""

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2)) + attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class FairseqLayer(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = FairseqSelfAttention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, x, self_attn_mask):
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(query=h, key=h, value=h, attn_mask=self_attn_mask)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class FairseqDecoder(nn.Module):
    """A fairseq ``TransformerDecoder``: the embeddings made time-major once, ``[t, b, c]``
    through every layer, batch-major again before the output projection."""

    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(FairseqLayer(dim) for _ in range(layers))
        self.layer_norm, self.output_projection = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, prev_output_tokens):
        x = self.embed_tokens(prev_output_tokens).transpose(0, 1)
        t = x.size(0)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), 1)
        for layer in self.layers:
            x = layer(x, self_attn_mask=mask)
        return self.output_projection(self.layer_norm(x).transpose(0, 1))


def fairseq_decoder() -> FairseqDecoder:
    torch.manual_seed(0)
    return FairseqDecoder()
