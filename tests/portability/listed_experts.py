"""Mixtures of experts written as an ``nn.ModuleList`` of expert modules, in the ways public
code writes the loop (none of it shaped around a planner):

- ``mistral_moe``: mistral's reference Mixtral layer: ``torch.where(selected == i)``, then
  ``results[batch_idx] += weights[batch_idx, nth, None] * expert(inputs[batch_idx])``, with a
  residual and norm around it in the block;
- ``deepseek_moe``: DeepSeek's inference code: sigmoid scores with top-k, the experts' token
  counts read with ``bincount(...).tolist()`` and idle experts skipped (``continue``), a shared
  expert added to the routed sum;
- ``hit_moe``: a research loop over only the experts some token picked (``nonzero`` of a
  one-hot count), top-1 by ``argmax``, the residual added inside the MoE module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import TokenLM


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MistralMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([SwiGLU(dim, hidden) for _ in range(num_experts)])
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts_per_tok = top_k

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs_squashed = inputs.view(-1, inputs.shape[-1])
        gate_logits = self.gate(inputs_squashed)
        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).type_as(inputs)
        results = torch.zeros_like(inputs_squashed)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs_squashed[batch_idx])
        return results.view_as(inputs)


class NamedMoE(nn.Module):
    """Experts in an ``nn.ModuleDict`` keyed by name, looked up by the chosen index."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": SwiGLU(dim, hidden) for i in range(num_experts)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for i in range(len(self.experts)):
            rows, slot = torch.where(chosen == i)
            out = out.index_add(0, rows, self.experts[f"expert_{i}"](flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class SequentialMoE(NamedMoE):
    """Experts in an ``nn.Sequential``, iterated (not chained)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__(dim, hidden, num_experts, top_k)
        self.experts = nn.Sequential(*(SwiGLU(dim, hidden) for _ in range(num_experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == i)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class ParamExpert(nn.Module):
    """An expert of raw parameters, no Linear: ``x @ self.w_in``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(dim, hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ self.w_in) @ self.w_out


class ParamMoE(MistralMoE):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__(dim, hidden, num_experts, top_k)
        self.experts = nn.ModuleList([ParamExpert(dim, hidden) for _ in range(num_experts)])


class WeightedExpert(SwiGLU):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # scales its own output
        return super().forward(x) * weight


class WeightedMoE(MistralMoE):
    """Each expert called with its rows and their routing weights, ``expert(x[idx], w[idx])``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__(dim, hidden, num_experts, top_k)
        self.experts = nn.ModuleList([WeightedExpert(dim, hidden) for _ in range(num_experts)])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.view(-1, inputs.shape[-1])
        weights, selected = torch.topk(self.gate(flat), self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).type_as(inputs)
        results = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(selected == i)
            results[rows] += expert(flat[rows], weights[rows, nth, None])
        return results.view_as(inputs)


class GroupedGate(nn.Module):
    """DeepSeek-V3's gate as a module of its own (its reference code's ``Gate``, HF's
    ``MoEGate``): a raw weight [E, H], sigmoid scores, a top-2 of each group's scores, the
    best groups kept, then the routing top-k; returns the chosen experts and their weights."""

    def __init__(self, dim: int, num_experts: int, top_k: int, groups: int = 4, top_groups: int = 2) -> None:
        super().__init__()
        self.top_k, self.groups, self.top_groups = top_k, groups, top_groups
        self.weight = nn.Parameter(torch.randn(num_experts, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight).sigmoid()
        grouped = scores.view(x.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.top_groups, dim=-1)[1]
        mask = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).unsqueeze(-1).expand_as(grouped)
        indices = torch.topk(grouped.masked_fill(mask == 0, 0.0).flatten(1), self.top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        return indices, weights / weights.sum(-1, keepdim=True)


class GatedMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = GroupedGate(dim, num_experts, top_k)
        self.experts = nn.ModuleList([SwiGLU(dim, hidden) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, x.shape[-1])
        indices, weights = self.gate(flat)
        y = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(indices == i)
            y[rows] += expert(flat[rows]) * weights[rows, nth, None]
        return y.view_as(x)


class DeepSeekMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_routed_experts, self.topk = num_experts, top_k
        self.weight = nn.Parameter(torch.randn(num_experts, dim) * dim ** -0.5)  # the gate as a raw weight
        self.experts = nn.ModuleList([SwiGLU(dim, hidden) for _ in range(num_experts)])
        self.shared_experts = SwiGLU(dim, 2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, shape[-1])
        scores = F.linear(x, self.weight).sigmoid()
        weights, indices = torch.topk(scores, self.topk, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.n_routed_experts):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


class CountedGateMoE(nn.Module):
    """DeepSeek-V3's reference ``MoE`` (inference/model.py): its ``Gate`` module returns
    weights and indices, the tokens per expert are counted with ``bincount(...).tolist()``
    and idle experts skipped, a shared expert added."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_routed_experts = num_experts
        self.gate = GroupedGate(dim, num_experts, top_k)
        self.experts = nn.ModuleList([SwiGLU(dim, hidden) for _ in range(num_experts)])
        self.shared_experts = SwiGLU(dim, 2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, shape[-1])
        indices, weights = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.n_routed_experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class HitMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 1) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(dim=-1)
        hit = F.one_hot(choice, len(self.experts)).sum(dim=0).nonzero()
        out = torch.zeros_like(flat)
        for index in hit:
            rows = torch.where(choice == index)[0]
            out[rows] = self.experts[int(index)](flat[rows])
        return x + out.view_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.feed_forward = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, d))
        return x + self.feed_forward(self.ffn_norm(x))


def moe_transformer(moe: type, *, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2,
                    num_experts: int = 4, top_k: int = 2, hidden: int = 48) -> TokenLM:
    return TokenLM([Block(dim, heads, moe(dim, hidden, num_experts, top_k)) for _ in range(layers)], dim=dim, vocab=vocab)


def mistral_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(MistralMoE)


def named_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(NamedMoE)


def sequential_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(SequentialMoE)


def param_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(ParamMoE)


def weighted_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(WeightedMoE)


def gated_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(GatedMoE, num_experts=8, top_k=3)


def deepseek_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(DeepSeekMoE, num_experts=8, top_k=2)


def counted_gate_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(CountedGateMoE, num_experts=8, top_k=3)


def hit_moe() -> TokenLM:
    torch.manual_seed(0)
    return moe_transformer(HitMoE, top_k=1)


def mixtral_8x7b() -> TokenLM:
    """mistral's reference layer at Mixtral 8x7B's sizes (attention with every kv head, no final norm), bf16 on meta."""
    with torch.device("meta"):
        return moe_transformer(MistralMoE, vocab=32000, dim=4096, heads=32, layers=32, num_experts=8, top_k=2,
                              hidden=14336).to(torch.bfloat16)
