"""Output heads tied to the token embedding by reading its weight, not by sharing a module:
research GPTs' ``F.linear(x, self.wte.weight)`` (OLMo v1 ties this way), ``x @ self.tok_emb.weight.T``
with a softcap and a loss in forward, and torchtune's ``TiedLinear`` (a plain object calling
``F.linear(x, self.tied_module.weight)``). Sizes are arguments; an odd vocabulary is allowed."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class LinearTiedGPT(nn.Module):
    """``logits = F.linear(self.ln_f(x), self.wte.weight)``."""

    def __init__(self, vocab_size=256, dim=64, n_head=4, n_layer=2, block_size=64):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MatmulTiedLM(nn.Module):
    """Scaled embedding in, ``x @ self.tok_emb.weight.T`` out, logits softcapped, and the loss
    computed in forward when targets are given (Gemma-like research code)."""

    def __init__(self, vocab_size=256, dim=64, n_head=4, n_layer=2, softcap=30.0):
        super().__init__()
        self.dim, self.softcap = dim, softcap
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.norm = RMSNorm(dim)

    def forward(self, tokens, targets=None):
        x = self.tok_emb(tokens) * math.sqrt(self.dim)
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.tok_emb.weight.T
        logits = self.softcap * torch.tanh(logits / self.softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def odd_vocab_gpt():
    """A vocabulary no tp divides (GPT-2's 50257 is odd too)."""
    return LinearTiedGPT(vocab_size=251)


def tune_llama3_2(vocab_size=256, dim=64, n_head=4, n_kv=2, n_layer=2, tied=True):
    """torchtune's Llama 3.2 (its 1B and 3B tie the output to the embedding with ``TiedLinear``)."""
    from benchmarks.ecosystem import shim_torchtune

    shim_torchtune()  # stubs for the packages torchtune imports and its model code never calls
    from torchtune.models.llama3_2 import llama3_2

    with torch.device("cpu"):  # its scaled RoPE builds its cache off meta only
        return llama3_2(vocab_size=vocab_size, num_layers=n_layer, num_heads=n_head, num_kv_heads=n_kv, embed_dim=dim,
                        max_seq_len=64, intermediate_dim=2 * dim, tie_word_embeddings=tied)
