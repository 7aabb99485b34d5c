"""Model code as people write it, one small model per way of spelling sizes (issue 30).

``InlineLM``: a user's own 50 lines, attention and MLP inline in one block, every width read
off the input (``B, T, D = x.shape``, ``qkv(x).split(D, dim=-1)``, ``reshape(B, T, D)``);
``split`` picks how the fused q/k/v is cut (a width, a list of widths, ``torch.split``;
``mask``: nanoGPT's path without flash, a causal buffer cut by ``T``; ``made``: the mask
made in forward, ``torch.ones(T, T).tril()``). ``InlineMQABlock``:
one kv head, RMSNorm and SwiGLU inline in the layer.
``SplitAttentionLM``: the same reads inside an attention module of its own, next to an MLP
module, with only the head count held as an attribute. ``MQALM``: one kv head broadcast by
``expand``; ``RopeLM``: RoPE spelled five ways (``view_as_complex`` times a table,
rotate-half, interleaved pairs flattened or stacked and shaped back by ``reshape_as``,
partial rotary), the table made in forward, kv heads
repeated by ``repeat_interleave`` (one kv head: MQA).
Small sizes, so they run on CPU; the builders at the end are specs for ``verify``.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class InlineBlock(nn.Module):
    def __init__(self, dim: int, heads: int, split: str = "width") -> None:
        super().__init__()
        self.heads, self.split = heads, split
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        if split == "mask":
            self.register_buffer("bias", torch.ones(2048, 2048, dtype=torch.bool).tril().view(1, 1, 2048, 2048))

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x))
        if self.split in ("width", "mask", "made"):
            q, k, v = qkv.split(D, dim=-1)
        elif self.split == "list":
            q, k, v = qkv.split([D, D, D], dim=2)
        else:
            q, k, v = torch.split(qkv, D, -1)
        q = q.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        if self.split == "mask":  # nanoGPT's path without flash attention: a causal buffer cut by T
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = att.softmax(dim=-1) @ v
        elif self.split == "made":  # the causal mask made in forward from T
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            att = att.masked_fill(torch.ones(T, T, device=x.device).tril() == 0, float("-inf"))
            y = att.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class InlineMQABlock(nn.Module):
    """One key/value head, attention and a SwiGLU MLP written inline in the layer, sizes read
    off its input: a user's own Falcon-style layer."""

    def __init__(self, dim: int, heads: int, split: str = "") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.down = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 1, 2 * self.head_dim).transpose(1, 2).chunk(2, dim=-1)
        y = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class InlineLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 96, heads: int = 6, layers: int = 2, split: str = "width",
                 block: type = InlineBlock) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim, heads, split) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, n_head)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SplitAttentionLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, n_head: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(Block(dim, n_head) for _ in range(layers)))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        return self.lm_head(self.norm(self.blocks(self.tok(idx))))


class LastTokenLM(SplitAttentionLM):
    """Logits of the last position only, as generation and reward heads take them."""

    def forward(self, idx):
        return self.lm_head(self.norm(self.blocks(self.tok(idx)))[:, -1, :])


class MeanPooledClassifier(SplitAttentionLM):
    """A sequence classifier: the final norm's output averaged over the tokens."""

    def __init__(self, classes: int = 10, **sizes) -> None:
        super().__init__(**sizes)
        self.lm_head = nn.Linear(self.lm_head.in_features, classes)

    def forward(self, idx):
        return self.lm_head(self.norm(self.blocks(self.tok(idx))).mean(dim=1))


class TiedFunctionalLM(SplitAttentionLM):
    """Logits from the embedding's own weight, written as a call (Gemma-style research code)."""

    def forward(self, idx):
        return F.linear(self.norm(self.blocks(self.tok(idx))), self.tok.weight)


def tied_functional() -> TiedFunctionalLM:
    torch.manual_seed(0)
    return TiedFunctionalLM()


def last_token() -> LastTokenLM:
    torch.manual_seed(0)
    return LastTokenLM()


def mean_pooled() -> MeanPooledClassifier:
    torch.manual_seed(0)
    return MeanPooledClassifier()


def inline() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM()


def inline_list() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(dim=128, heads=8, split="list")


def inline_functional() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(split="functional")


def inline_mask() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(split="mask")


def inline_made_mask() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(split="made")


def inline_mqa() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(dim=128, heads=8, block=InlineMQABlock)


class InlinePositionsLM(InlineLM):
    """The inline blocks behind a learned position table the model's forward slices by the
    input's length, nanoGPT's first blocks with minGPT's ``pos_emb`` Parameter."""

    def __init__(self, max_len: int = 64, **sizes) -> None:
        super().__init__(**sizes)
        self.pos_emb = nn.Parameter(0.02 * torch.randn(1, max_len, self.emb.embedding_dim))

    def forward(self, idx):
        b, t = idx.size()
        x = self.emb(idx) + self.pos_emb[:, :t, :]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def inline_positions() -> InlinePositionsLM:
    torch.manual_seed(0)
    return InlinePositionsLM()


def split_attention() -> SplitAttentionLM:
    torch.manual_seed(0)
    return SplitAttentionLM()


class MQAAttention(nn.Module):
    """One key/value head read by every query head (PaLM, Falcon-7B, StarCoder), the shared
    head broadcast with ``expand`` as hand-written code does it."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 1, 2 * self.head_dim).transpose(1, 2).chunk(2, dim=-1)
        k, v = k.expand(-1, self.n_head, -1, -1), v.expand(-1, self.n_head, -1, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MQABlock(Block):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__(dim, n_head)
        self.attn = MQAAttention(dim, n_head)


class MQALM(SplitAttentionLM):
    def __init__(self, vocab: int = 256, dim: int = 128, n_head: int = 8, layers: int = 2) -> None:
        super().__init__(vocab, dim, n_head, layers)
        self.blocks = nn.Sequential(*(MQABlock(dim, n_head) for _ in range(layers)))


def mqa() -> MQALM:
    torch.manual_seed(0)
    return MQALM()


def hf_llama_mqa() -> nn.Module:
    """Hugging Face's Llama with one kv head (repeat_kv's expand, then reshape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=64))


def hf_gpt2_odd_vocab() -> nn.Module:
    """Hugging Face's GPT-2 (Conv1D projections, a fused ``c_attn`` cut by ``split``, learned
    positions, a tied head) with a vocabulary no tp divides, as GPT-2's own 50257."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # no dropout: a rank's heads draw other masks than the whole model's
    return GPT2LMHeadModel(GPT2Config(vocab_size=509, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


# RoPE as people write it: complex numbers, rotate-half, interleaved pairs, partial rotary

def rope_complex(x, freqs):  # Meta's llama: view_as_complex times a [seq, hd/2] table
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    f = freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * f).flatten(3).type_as(x)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

def rope_half(x, cos, sin):  # HF style, x [b, h, s, d], cos [s, d]
    return x * cos + rotate_half(x) * sin

def rope_interleaved(x, cos, sin):  # GPT-J's interleaved pairs, x [b, s, h, d], cos [s, d/2]
    x1, x2 = x[..., ::2], x[..., 1::2]
    c, s_ = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s_, x1 * s_ + x2 * c), dim=-1).flatten(-2)

class RopeAttention(nn.Module):
    """q, k, v projections, RoPE in one of four spellings, kv heads repeated by
    ``repeat_interleave`` (one kv head: MQA)."""

    def __init__(self, dim, heads, kv, style, partial=1.0):
        super().__init__()
        self.h, self.kv, self.hd, self.style = heads, kv, dim // heads, style
        self.rot = int(self.hd * partial)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.rot, 2).float() / self.rot))
        self.register_buffer("inv_freq", inv, persistent=False)
        if style == "complex":
            t = torch.arange(256).float()
            self.register_buffer("freqs", torch.polar(torch.ones(256, self.rot // 2), torch.outer(t, inv)), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.hd)
        k = self.wk(x).view(b, s, self.kv, self.hd)
        v = self.wv(x).view(b, s, self.kv, self.hd)
        t = torch.arange(s, device=x.device).float()
        ang = torch.outer(t, self.inv_freq)
        if self.style == "complex":
            q, k = rope_complex(q, self.freqs), rope_complex(k, self.freqs)
        elif self.style == "interleaved":
            q, k = rope_interleaved(q, ang.cos(), ang.sin()), rope_interleaved(k, ang.cos(), ang.sin())
        elif self.style == "stack_as":  # RoFormer's: each pair rotated by stack, shaped back by reshape_as(q)
            cos, sin = ang.cos().repeat_interleave(2, dim=-1), ang.sin().repeat_interleave(2, dim=-1)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).reshape_as(q) * sin
            k = k * cos + torch.stack([-k[..., 1::2], k[..., ::2]], dim=-1).reshape_as(k) * sin
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        elif self.style in ("half", "partial"):
            emb = torch.cat((ang, ang), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            if self.rot < self.hd:
                qr, qp = q[..., : self.rot], q[..., self.rot :]
                kr, kp = k[..., : self.rot], k[..., self.rot :]
                q = torch.cat((rope_half(qr, cos, sin), qp), dim=-1)
                k = torch.cat((rope_half(kr, cos, sin), kp), dim=-1)
            else:
                q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))

class RopeBlock(nn.Module):
    def __init__(self, dim, heads, kv, style, partial):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = RopeAttention(dim, heads, kv, style, partial)
        self.w1, self.w2 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)
    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.w2(F.silu(self.w1(self.n2(x))))

class RopeLM(nn.Module):
    def __init__(self, dim=128, heads=8, kv=4, style="half", partial=1.0, layers=2, vocab=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(RopeBlock(dim, heads, kv, style, partial) for _ in range(layers))
        self.norm = nn.RMSNorm(dim); self.out = nn.Linear(dim, vocab, bias=False)
    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks: x = b(x)
        return self.out(self.norm(x))


def rope(style: str, **sizes) -> RopeLM:
    torch.manual_seed(0)
    return RopeLM(style=style, **sizes)


def rope_complex_lm() -> RopeLM:
    return rope("complex")


def rope_interleaved_lm() -> RopeLM:
    return rope("interleaved")


def rope_stack_as_lm() -> RopeLM:
    return rope("stack_as")


def rope_partial_lm() -> RopeLM:
    return rope("partial", partial=0.5)


def mqa_repeat_interleave() -> RopeLM:
    return rope("half", kv=1)


def rope_complex_gqa() -> RopeLM:
    """2 kv heads for 8 query heads: at tp=4 each kv head is held by the 2 ranks reading it."""
    return rope("complex", kv=2)


# A fused q/k/v of unequal widths (gpt-fast, litgpt): 8 query heads and 2 kv heads in one Linear


class FusedGQAAttention(nn.Module):
    def __init__(self, dim: int = 128, n_head: int = 8, n_local_heads: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim = n_head, n_local_heads, dim // n_head, dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class FusedGQALM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(FusedGQAAttention(dim) for _ in range(layers))
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.output(x)


def fused_gqa() -> FusedGQALM:
    torch.manual_seed(0)
    return FusedGQALM()


def _fused_lm(attention) -> FusedGQALM:
    """``FusedGQALM`` with its layers' attention built by ``attention()``."""
    torch.manual_seed(0)
    model = FusedGQALM()
    model.layers = nn.ModuleList(attention() for _ in range(2))
    return model


def fused_mqa() -> FusedGQALM:
    """gpt-fast's attention with one kv head (``n_local_heads=1``): [Q; K; V] of unequal
    widths in one Linear, the kv head repeated to every query head."""
    return _fused_lm(lambda: FusedGQAAttention(128, 8, 1))


class FalconMQAAttention(nn.Module):
    """Falcon-7B's multi-query attention: q heads and the one k and v head fused in one
    Linear, its output viewed as ``heads + 2`` heads and indexed apart (``[..., :-2, :]``,
    ``[..., [-2], :]``), the shared head broadcast by the matmul."""

    def __init__(self, dim: int = 128, n_head: int = 8) -> None:
        super().__init__()
        self.num_heads, self.head_dim = n_head, dim // n_head
        self.query_key_value = nn.Linear(dim, dim + 2 * self.head_dim, bias=False)
        self.dense = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.query_key_value(x).view(b, s, self.num_heads + 2, self.head_dim)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.dense(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


def falcon_mqa() -> FusedGQALM:
    return _fused_lm(FalconMQAAttention)


class LitGPTAttention(nn.Module):
    """litgpt's attention before 2024: the fused rows ordered per query group, viewed
    ``(B, T, groups, q_per_kv + 2, hs)``, permuted, and split ``(q_per_kv, 1, 1)``; one
    group here (multi-query: Gemma 2B, Falcon-7B), its k and v expanded to every head."""

    def __init__(self, dim: int = 128, n_head: int = 8, n_query_groups: int = 1) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, dim // n_head
        self.attn = nn.Linear(dim, (n_head + 2 * n_query_groups) * self.head_size)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.size()
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, self.head_size)
        q, k, v = qkv.permute(0, 2, 3, 1, 4).split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        v = v.expand(B, self.n_query_groups, q_per_kv, T, self.head_size)
        q, k, v = (t.reshape(B, -1, T, self.head_size) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def litgpt_mqa() -> FusedGQALM:
    return _fused_lm(LitGPTAttention)


class UnflattenAttention(nn.Module):
    """Attention that reads no size off its input: heads by ``unflatten(-1, (heads, -1))``."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class FlatMLPBlock(nn.Module):
    """OPT's decoder layer as a user writes it: attention on ``[B, T, C]``, then the tokens
    flattened (``x.reshape(-1, C)``) for the norm and MLP, and viewed back."""

    def __init__(self, dim: int = 128, n_head: int = 8) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), UnflattenAttention(dim, n_head)
        self.ln_2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        shape = x.shape
        x = x.reshape(-1, x.size(-1))
        x = x + self.fc2(F.relu(self.fc1(self.ln_2(x))))
        return x.view(shape)


def flat_mlp() -> SplitAttentionLM:
    torch.manual_seed(0)
    model = SplitAttentionLM()
    model.blocks = nn.Sequential(*(FlatMLPBlock() for _ in range(2)))
    return model


# A packed q/k/v cut apart the other ways people write it, the width read off the input


class CutAttention(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 8, cut: str = "slice") -> None:
        super().__init__()
        self.heads, self.cut = heads, cut
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x)
        if self.cut == "slice":
            q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        elif self.cut == "narrow":
            q, k, v = qkv.narrow(-1, 0, C), qkv.narrow(-1, C, C), qkv.narrow(-1, 2 * C, C)
        if self.cut in ("slice", "narrow"):
            q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        elif self.cut == "unpack":  # iterating a [3, B, heads, T, hd] tensor
            q, k, v = qkv.reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class CutLM(nn.Module):
    def __init__(self, cut: str, vocab: int = 256, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(CutAttention(dim, cut=cut) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for attn in self.attn:
            x = x + attn(x)
        return self.head(x)


def cut_slice() -> CutLM:
    torch.manual_seed(0)
    return CutLM("slice")


def cut_narrow() -> CutLM:
    torch.manual_seed(0)
    return CutLM("narrow")


def cut_unpack() -> CutLM:
    torch.manual_seed(0)
    return CutLM("unpack")


def cut_unflatten() -> CutLM:
    torch.manual_seed(0)
    return CutLM("unflatten")


# ALiBi with the heads folded into the batch (Megatron-DeepSpeed's and Bloom's spelling): the
# root makes the bias once, [b * heads, 1, keys], every block adds it to scores folded the same way


def alibi_slopes(heads: int) -> torch.Tensor:
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class FoldedAlibiAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, alibi, mask):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2).reshape(b * self.heads, s, self.head_dim)
                   for p in (self.q, self.k, self.v))
        scores = alibi.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=self.head_dim ** -0.5)
        probs = (scores.view(b, self.heads, s, s) + mask).softmax(-1).view(b * self.heads, s, s)
        y = torch.bmm(probs, v).view(b, self.heads, s, self.head_dim).transpose(1, 2).reshape(b, s, -1)
        return self.o(y)


class FoldedAlibiBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FoldedAlibiAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, alibi, mask):
        x = x + self.attn(self.ln1(x), alibi, mask)
        return x + self.mlp(self.ln2(x))


class FoldedAlibiLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 96, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FoldedAlibiBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        b, s = idx.shape
        x = self.emb(idx)
        slopes = alibi_slopes(self.heads).to(x.device)
        alibi = (slopes[:, None, None] * torch.arange(s, device=x.device)).repeat(b, 1, 1)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        for block in self.blocks:
            x = block(x, alibi=alibi, mask=mask)
        return self.head(x)


def folded_alibi() -> FoldedAlibiLM:
    torch.manual_seed(0)
    return FoldedAlibiLM()


# q and k normalized over all heads together (OLMo 2's q_norm/k_norm of [b, s, heads * hd]),
# the norm written out as people write it: RMSNorm by pow/mean/rsqrt, LayerNorm by mean/var


class HandRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class HandLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class QKNormAttention(nn.Module):
    def __init__(self, dim: int, heads: int, norm: type) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = norm(dim), norm(dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        q, k, v = (t.view(b, s, -1, x.shape[-1] // self.heads).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class QKNormLM(nn.Module):
    def __init__(self, norm: type, vocab: int = 256, dim: int = 256, heads: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(HandRMSNorm(dim) for _ in range(layers))
        self.attn = nn.ModuleList(QKNormAttention(dim, heads, norm) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for norm, attn in zip(self.norms, self.attn):
            x = x + attn(norm(x))
        return self.head(x)


def qk_rms_norm() -> QKNormLM:
    torch.manual_seed(0)
    return QKNormLM(HandRMSNorm)


def torch_rms_norm(dim: int) -> nn.RMSNorm:
    """Torch's own fused ``nn.RMSNorm`` (OLMo-core, torchtitan-style code), weights not all one."""
    norm = nn.RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(dim, device=norm.weight.device))
    return norm


def qk_torch_rms_norm() -> QKNormLM:
    torch.manual_seed(0)
    return QKNormLM(torch_rms_norm)


def qk_layer_norm() -> QKNormLM:
    torch.manual_seed(0)
    return QKNormLM(HandLayerNorm)


class PositionalEncoding(nn.Module):
    """The PyTorch tutorial's sinusoidal table, a buffer added to the embedding by the input's length."""

    def __init__(self, dim: int, max_len: int = 512) -> None:
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe = torch.zeros(1, max_len, dim)
        pe[0, :, 0::2], pe[0, :, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class SinusoidalLM(SplitAttentionLM):
    """Pre-norm blocks after a position-encoding module made of a buffer."""

    def __init__(self, vocab: int = 256, dim: int = 96, n_head: int = 6, layers: int = 2) -> None:
        super().__init__(vocab, dim, n_head, layers)
        self.pos = PositionalEncoding(dim)

    def forward(self, idx):
        return self.lm_head(self.norm(self.blocks(self.pos(self.tok(idx) * math.sqrt(self.tok.embedding_dim)))))


def sinusoidal() -> SinusoidalLM:
    torch.manual_seed(0)
    return SinusoidalLM()


class LearnedPositionsLM(SplitAttentionLM):
    """minGPT's first version: a learned position table the model's own forward slices by
    the input's length and adds to the tokens (or, ``buffer``, a fixed sinusoidal table
    registered on the model itself), the sum handed to the blocks."""

    def __init__(self, max_len: int = 64, buffer: bool = False, **sizes) -> None:
        super().__init__(**sizes)
        table = 0.02 * torch.randn(1, max_len, self.tok.embedding_dim)
        if buffer:
            self.register_buffer("pos_emb", table)
        else:
            self.pos_emb = nn.Parameter(table)

    def forward(self, idx):
        x = self.tok(idx) + self.pos_emb[:, : idx.size(1), :]
        return self.lm_head(self.norm(self.blocks(x)))


def learned_positions() -> LearnedPositionsLM:
    torch.manual_seed(0)
    return LearnedPositionsLM()


def fixed_positions() -> LearnedPositionsLM:
    torch.manual_seed(0)
    return LearnedPositionsLM(buffer=True, layers=3)


class LatentAttention(nn.Module):
    """lucidrains' Perceiver attention: a context of its own width, ``reshape(b, n, h, -1)``
    by the module's global head count, einsum scores."""

    def __init__(self, dim: int, context_dim: int, heads: int = 4, dim_head: int = 16) -> None:
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(context_dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x, context=None):
        context = x if context is None else context
        q, (k, v) = self.to_q(x), self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        attn = (torch.einsum("bhid,bhjd->bhij", q, k) * self.scale).softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1))


class PerceiverLM(nn.Module):
    """Latents cross-attend to the tokens, run a stack of self-attention, and the tokens
    cross-attend back: the two cross-attentions are called by the model's own forward,
    beside the stack, not in it."""

    def __init__(self, vocab: int = 256, dim: int = 64, latent_dim: int = 96, latents: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.latents = nn.Parameter(torch.randn(latents, latent_dim))
        self.encode = LatentAttention(latent_dim, dim)
        self.layers = nn.ModuleList(LatentAttention(latent_dim, latent_dim, dim_head=24) for _ in range(depth))
        self.decode = LatentAttention(dim, latent_dim)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, idx):
        x = self.tok(idx)
        lat = self.latents.unsqueeze(0).expand(idx.shape[0], -1, -1)
        lat = self.encode(lat, context=x) + lat
        for layer in self.layers:
            lat = layer(lat) + lat
        return self.head(self.decode(x, context=lat) + x)


def perceiver() -> PerceiverLM:
    torch.manual_seed(0)
    return PerceiverLM()


class TorchMHABlock(nn.Module):
    """``nn.MultiheadAttention`` in a pre-norm block of one's own, its weights unpacked and
    dropped: ``a, _ = self.attn(h, h, h, need_weights=False, ...)``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, key_padding_mask=None, attn_mask=None):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TorchMHALM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(0.02 * torch.randn(1, max_len, dim))
        self.blocks = nn.ModuleList(TorchMHABlock(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, input_ids):
        t = input_ids.size(1)
        pad = input_ids == 0
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
        x = self.tok(input_ids) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, key_padding_mask=pad, attn_mask=causal)
        return self.head(self.ln_f(x))


def torch_mha() -> TorchMHALM:
    torch.manual_seed(0)
    return TorchMHALM()
