"""Routing along the tokens, as Switch Transformer's and expert-choice code write it: the
result for one token depends on the other tokens of the batch (a capacity filled in token
order; each expert picking its top tokens), so a data-parallel rank, which routes its own
rows, differs from one process on the whole batch. Experts in an ``nn.ModuleList`` after a
router Linear, as the planner's expert lists are."""

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SwitchMoE(nn.Module):
    """Top-1 with an expert capacity (Switch Transformer): a token's place in its expert's
    queue is a ``cumsum`` over the tokens; tokens past the capacity are dropped."""

    def __init__(self, dim: int = 64, experts: int = 4, capacity_factor: float = 1.0) -> None:
        super().__init__()
        self.num_experts, self.capacity_factor = experts, capacity_factor
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, 2 * dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x = x.reshape(-1, h)
        gate, choice = self.router(x).softmax(dim=-1).max(dim=-1)
        mask = F.one_hot(choice, self.num_experts)
        position = torch.cumsum(mask, dim=0) * mask
        capacity = int(self.capacity_factor * b * s / self.num_experts)
        kept = mask * (position <= capacity)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = kept[:, e].nonzero(as_tuple=True)[0]
            out = out.index_add(0, rows, expert(x[rows]) * gate[rows, None])
        return out.view(b, s, h)


class ExpertChoiceMoE(SwitchMoE):
    """Expert choice (Zhou et al. 2022): each expert takes its top ``capacity`` tokens, a
    ``topk`` over the tokens of the transposed scores."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x = x.reshape(-1, h)
        scores = self.router(x).softmax(dim=-1)
        capacity = int(self.capacity_factor * b * s / self.num_experts)
        weights, rows = torch.topk(scores.t(), capacity, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out.index_add(0, rows[e], expert(x[rows[e]]) * weights[e, :, None])
        return out.view(b, s, h)


class TopKMoE(nn.Module):
    """The control: top-2 over each token's own scores (Mixtral's routing) mixes nothing."""

    def __init__(self, dim: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, 2 * dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x = x.reshape(-1, h)
        weights, chosen = torch.topk(self.router(x).softmax(dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(b, s, h)


class MoELM(nn.Module):
    def __init__(self, moe: type, dim: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.moe = moe(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.moe(self.norm(x)))


def switch_lm() -> MoELM:
    torch.manual_seed(0)
    return MoELM(SwitchMoE)


def expert_choice_lm() -> MoELM:
    torch.manual_seed(0)
    return MoELM(ExpertChoiceMoE)


def top_k_lm() -> MoELM:
    torch.manual_seed(0)
    return MoELM(TopKMoE)
