"""Torchtitan-style Llama 3 decoder, written to be planned and sharded.

Contract:

* Plain ``nn.Module`` with torchtitan module names: ``tok_embeddings``,
  ``layers.<i>.{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
  feed_forward.{w1,w2,w3}}``, ``norm``, ``output``. Plans written against
  torchtitan FQNs therefore apply unchanged.
* ``Transformer.forward(tokens: LongTensor[bs, seqlen]) -> logits[bs, seqlen, vocab]``.
* Traceable by ``torch.fx`` when meta tensors run along with the trace and by
  ``torch.export``: the only Python control flow is on shapes, never on values.
* Correct under tensor parallelism with local (sharded) outputs: attention never
  uses a stored head count. Heads are recovered with ``view(..., -1, head_dim)``
  and the GQA repeat factor is computed from the local q/kv shapes at run time,
  so a rank that holds ``n_heads / tp`` query heads and ``n_kv_heads / tp`` kv
  heads computes exactly its slice of the full attention.
* RoPE is real-valued (cos/sin, rotate-half form); complex tensors are avoided
  because DTensor and meta-tensor support for them is patchy.
* Buildable on the meta device at 405B scale: no construction step touches
  values. After ``to_empty(device=...)`` call ``init_weights(seed)`` to get real
  weights and RoPE tables; with the same seed these equal the weights of a model
  constructed directly on CPU after ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "LlamaConfig",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "ffn_hidden_dim",
    "precompute_rope",
]


@dataclass
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Torchtitan/Meta rule: 2/3 of 4*dim (SwiGLU keeps params ~ a 4x GELU MLP),
    scaled, then rounded up so the hidden size shards evenly."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin), each (max_seq_len, head_dim), for the rotate-half form."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (bs, seqlen, heads, head_dim) by (seqlen, head_dim) tables.

    The tables broadcast over the head axis, so any number of local heads works."""
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # Unconditional expand+reshape (a view when n_rep == 1) keeps the graph free
    # of branches, and indexing shape (not unpacking it) keeps it fx-friendly.
    bs, seqlen, n_kv, head_dim = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # Only head_dim is stored: head counts must come from tensor shapes so
        # that a tensor-parallel rank with a fraction of the heads still works.
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = apply_rotary_emb(xq, cos, sin)
        xk = apply_rotary_emb(xk, cos, sin)
        n_rep = xq.shape[2] // xk.shape[2]
        xk = _repeat_kv(xk, n_rep)
        xv = _repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder: tokens (bs, seqlen) -> logits (bs, seqlen, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Non-persistent: derived from the config, so checkpoints need not carry
        # them and a meta-built model only has to recompute them.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables on the device the model currently lives on."""
        cfg = self.config
        device = self.tok_embeddings.weight.device
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device)
        self.rope_cos = cos
        self.rope_sin = sin

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Reinitialise in place (e.g. after ``to_empty``).

        Modules are reset in construction order, so with the same seed this
        reproduces the weights of a model built on CPU after
        ``torch.manual_seed(seed)``. The ``nn`` defaults keep logits O(1):
        the final RMSNorm gives unit-RMS features and ``output`` uses
        U(-1/sqrt(dim), 1/sqrt(dim)), so logit std is about 0.6."""
        if seed is not None:
            torch.manual_seed(seed)
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self.reset_rope()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        # narrow rather than [:seqlen]: a torch call, so even a purely symbolic
        # fx trace (seqlen a Proxy) records it instead of failing.
        cos = torch.narrow(self.rope_cos, 0, 0, seqlen)
        sin = torch.narrow(self.rope_sin, 0, 0, seqlen)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
