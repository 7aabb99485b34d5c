"""Model code as people write it, one small model per way of spelling sizes (issue 30).

``InlineLM``: a user's own 50 lines, attention and MLP inline in one block, every width read
off the input (``B, T, D = x.shape``, ``qkv(x).split(D, dim=-1)``, ``reshape(B, T, D)``);
``split`` picks how the fused q/k/v is cut (a width, a list of widths, ``torch.split``).
``SplitAttentionLM``: the same reads inside an attention module of its own, next to an MLP
module, with only the head count held as an attribute.
Small sizes, so they run on CPU; the builders at the end are specs for ``verify``.
"""

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

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x))
        if self.split == "width":
            q, k, v = qkv.split(D, dim=-1)
        elif self.split == "list":
            q, k, v = qkv.split([D, D, D], dim=2)
        else:
            q, k, v = torch.split(qkv, D, -1)
        q = q.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class InlineLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 96, heads: int = 6, layers: int = 2, split: str = "width") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(InlineBlock(dim, heads, split) for _ in range(layers))
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


def inline() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM()


def inline_list() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(dim=128, heads=8, split="list")


def inline_functional() -> InlineLM:
    torch.manual_seed(0)
    return InlineLM(split="functional")


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
