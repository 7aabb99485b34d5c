"""GPT-2-style decoders: the sequential ``GPT2`` and a GPT-J-style ``ParallelBlockModel``.

Contract:

* Plain ``nn.Module``s; ``forward(input_ids: LongTensor[bs, seqlen]) ->
  logits[bs, seqlen, vocab]``.
* Module names: ``wte``, ``wpe``, ``drop``, ``h.<i>.{ln_1, attn.{q_proj, k_proj,
  v_proj, c_proj}, ln_2, mlp.{c_fc, c_proj}}``, ``ln_f``, ``lm_head``. Q/K/V are
  separate biased projections (not GPT-2's fused ``c_attn``) so each can be
  sharded column-wise on its own.
* ``GPT2.lm_head.weight`` *is* ``GPT2.wte.weight`` (tied). ``ParallelBlockModel``
  keeps an untied head and has no ``ln_2``: each block computes
  ``h = ln_1(x); x = x + (attn(h) + mlp(h))``, the pattern where a planner can
  fuse the two row-parallel reductions into one.
* Traceable by ``torch.fx`` with meta tensors along and by ``torch.export``;
  correct under tensor parallelism with a fraction of the heads per rank, because
  heads are recovered with ``view(..., -1, head_dim)``, never a stored count.
* Buildable on the meta device; after ``to_empty`` call ``init_weights(seed)``,
  which also re-ties the head (``to_empty`` replaces parameters one module at a
  time and so unties them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalSelfAttention", "GPT2", "GPT2Block", "GPT2Config", "GPT2MLP",
           "ParallelBlock", "ParallelBlockModel"]

_INIT_STD = 0.02  # GPT-2's init; with a tied head, N(0, 1) embeddings give huge logits.


@dataclass
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def max_seq_len(self) -> int:
        return self.n_positions


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        # Only head_dim is stored; see the module docstring.
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=True)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=True)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=True)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.q_proj(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=True)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        # Branches summed before the residual: one partial sum, one all-reduce.
        return x + (self.attn(h) + self.mlp(h))


class _GPTBase(nn.Module):
    """Embeddings, block stack, final norm and head shared by both variants."""

    def __init__(self, cfg: GPT2Config, block: type[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._init_values()

    def tie_weights(self) -> None:
        """Hook for tying the head; the base model leaves it untied."""

    @torch.no_grad()
    def _init_values(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_weights(self, seed: int | None = None) -> None:
        """Reinitialise in place (e.g. after ``to_empty``); same seed, same weights
        as a model constructed on CPU after ``torch.manual_seed(seed)``."""
        self.tie_weights()
        if seed is not None:
            torch.manual_seed(seed)
        self._replay_construction_rng()
        self._init_values()

    @torch.no_grad()
    def _replay_construction_rng(self) -> None:
        # Construction runs the nn default inits (including the head's, before it
        # is tied) ahead of _init_values; replaying them in module order keeps the
        # RNG stream, hence the final weights, identical to a fresh CPU build.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seqlen = input_ids.shape[1]
        pos = torch.arange(seqlen, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPT2(_GPTBase):
    """GPT-2 with a tied LM head: input_ids (bs, seqlen) -> logits (bs, seqlen, vocab)."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__(cfg, GPT2Block)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.wte.weight


class ParallelBlockModel(_GPTBase):
    """GPT-J-style parallel attention/MLP blocks sharing one LayerNorm; untied head."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__(cfg, ParallelBlock)
