"""A MoE decoder written as torchtitan writes its MoE layer (``models/common/moe``), small.

The router picks top-k experts per token; the layer sorts the (token, slot) pairs by expert,
counts them per expert (``histc``), gathers the rows (scaled by their scores before the
experts, torchtitan's ``score_before_experts``) and calls the bank as
``experts(num_tokens_per_expert [E], routed_input [T * k, H])``; the bank runs each expert
on its run of rows (``torch.split`` by the counts) and the layer adds the rows back onto
their tokens (``scatter_add``). Shared experts beside the routed ones, as DeepSeek-V3's.
A spec for ``verify`` (``tests.portability.titan_moe:titan_moe``).
"""

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """w1 and w3 ``[E, I, H]``, w2 ``[E, H, I]``: torchtitan's layout and calling convention."""

    def __init__(self, dim: int, inner: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, inner, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, inner) * inner**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, inner, dim) * dim**-0.5)

    def forward(self, num_tokens_per_expert: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = []
        for i, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(rows @ self.w1[i].transpose(0, 1)) * (rows @ self.w3[i].transpose(0, 1))
            out.append(h @ self.w2[i].transpose(0, 1))
        return torch.cat(out, dim=0)


class GroupedExpertsBmm(nn.Module):
    """torchtitan's first layout (early 2025): w1, w3 ``[E, H, I]``, w2 ``[E, I, H]``, used as
    ``rows @ w1[i]``; by shapes alone it reads as well as ``[E, X, H]`` + ``[E, H, I]``."""

    def __init__(self, dim: int, inner: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, inner) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, inner, dim) * inner**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, dim, inner) * dim**-0.5)

    def forward(self, num_tokens_per_expert: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = []
        for i, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            out.append((F.silu(rows @ self.w1[i]) * (rows @ self.w3[i])) @ self.w2[i])
        return torch.cat(out, dim=0)


class MoE(nn.Module):
    def __init__(self, dim: int, inner: int, num_experts: int = 4, top_k: int = 2, bank: type = GroupedExperts) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = bank(dim, inner, num_experts)
        self.shared = nn.Sequential(nn.Linear(dim, inner, bias=False), nn.SiLU(), nn.Linear(inner, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        x = x.reshape(-1, d)
        scores = self.router(x).softmax(dim=-1, dtype=torch.float32)
        top_scores, selected = scores.topk(self.top_k, dim=-1)
        num_tokens_per_expert = torch.histc(selected.reshape(-1).float(), bins=self.num_experts, min=0,
                                            max=self.num_experts)
        order = torch.argsort(selected.reshape(-1), stable=True)
        token_indices = order // self.top_k
        routed_input = x[token_indices] * top_scores.reshape(-1, 1)[order].to(x.dtype)
        routed_output = self.experts(num_tokens_per_expert.long(), routed_input)
        out = self.shared(x).scatter_add(0, token_indices.unsqueeze(-1).expand(-1, d), routed_output)
        return out.reshape(b, s, d)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, bank: type = GroupedExperts) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.moe = MoE(dim, inner, bank=bank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(y)
        return x + self.moe(self.ffn_norm(x))


class TitanMoE(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4, inner: int = 48, layers: int = 2,
                 bank: type = GroupedExperts) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, inner, bank) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def titan_moe() -> TitanMoE:
    torch.manual_seed(0)
    return TitanMoE()


def titan_bmm_moe() -> TitanMoE:
    torch.manual_seed(0)
    return TitanMoE(bank=GroupedExpertsBmm)
