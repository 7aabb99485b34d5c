"""A user's MoE decoder written from scratch: a top-2 router, experts in an ``nn.ModuleList``
looped over with ``index_add_`` into zeros, a shared expert, learned positions
(issue 30's class 6, issue 31). Kept as written, the ``continue`` for an idle expert included;
``user_moe(skip=False)`` drops it (a fake process group routes every token alike, so idle
experts there skip collectives a real run makes)."""

from __future__ import annotations
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim, n_experts=4, top_k=2, hidden=128):
        super().__init__()
        self.top_k = top_k
        self.skip_idle = True
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(n_experts)])
        self.shared_expert = Expert(dim, hidden)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.view(-1, C)
        logits = self.gate(flat)
        weights, selected = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(weights, dim=-1, dtype=torch.float).to(x.dtype)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            token_idx, k_idx = torch.where(selected == i)
            if self.skip_idle and token_idx.numel() == 0:
                continue
            y = expert(flat[token_idx]) * weights[token_idx, k_idx, None]
            out.index_add_(0, token_idx, y)
        out = out + self.shared_expert(flat)
        return out.view(B, T, C)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=-1)
        q = q.view(B, T, self.heads, -1).transpose(1, 2)
        k = k.view(B, T, self.heads, -1).transpose(1, 2)
        v = v.view(B, T, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = MoE(dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, max_len=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def user_moe(skip: bool = True) -> Model:
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        block.moe.skip_idle = skip
    return model


def user_moe_no_skip() -> Model:
    return user_moe(skip=False)
