"""A small, configurable decoder-only transformer for the property tests.

Written plainly, the way such models are written outside shardplan: ``nn.Embedding``,
an optional learned position embedding, ``n_layers`` blocks of attention + MLP with
pre-norms (LayerNorm or RMSNorm), a final norm and an LM head (optionally tied to the
token embedding). Head counts are never stored: attention recovers them from tensor
shapes (``view(b, s, -1, head_dim)``) and the GQA repeat factor from the local q/kv
shapes, so a rank that holds 1/tp of the heads computes its slice of the attention.

Variants (all from :class:`PropConfig`):

* ``fused_qkv``: one Linear for q, k and v. With as many kv heads as heads it is split
  with ``chunk(3, -1)``; with GQA by sizes computed from the local tensor and the
  (tp-invariant) ratio ``n_heads // n_kv_heads``.
* ``gqa``: ``"expand"`` (``x[:, :, :, None].expand(...).reshape(...)``) or
  ``"repeat_interleave"``.
* ``mlp``: ``"gelu"`` (fc1 -> gelu -> fc2), ``"swiglu"`` (w1, w3 -> silu(w1) * w3 -> w2) or
  ``"swiglu_fused"`` (one gate_up Linear split with ``chunk(2, -1)``).
* ``bias`` on every Linear (and LayerNorm), ``tied`` embeddings, ``pos_emb``.

``random_config(seed)`` draws a config deterministically from ``random.Random(seed)``;
``build(cfg, device=..., seed=...)`` builds the model (on ``"meta"`` no value is touched).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PropConfig", "PropTransformer", "random_config", "build", "example_ids"]


@dataclass(frozen=True)
class PropConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 16
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    mlp: str = "gelu"  # "gelu" | "swiglu" | "swiglu_fused"
    gqa: str = "expand"  # "expand" | "repeat_interleave"
    fused_qkv: bool = False
    bias: bool = True
    tied: bool = False
    pos_emb: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.norm not in ("layernorm", "rmsnorm") or self.mlp not in ("gelu", "swiglu", "swiglu_fused"):
            raise ValueError(f"unknown norm {self.norm!r} or mlp {self.mlp!r}")
        if self.gqa not in ("expand", "repeat_interleave"):
            raise ValueError(f"unknown gqa {self.gqa!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    @property
    def short(self) -> str:
        """A compact id: every field that differs from a plain GPT-ish block, in order."""
        parts = [
            f"d{self.dim}", f"L{self.n_layers}", f"h{self.n_heads}", f"kv{self.n_kv_heads}", f"v{self.vocab_size}",
            f"x{self.mlp_ratio}", "ln" if self.norm == "layernorm" else "rms", self.mlp,
        ]
        if self.n_kv_heads != self.n_heads:
            parts.append("ri" if self.gqa == "repeat_interleave" else "exp")
        parts += [flag for flag, on in (("qkv", self.fused_qkv), ("bias", self.bias), ("tied", self.tied),
                                        ("pos", self.pos_emb)) if on]
        return "-".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def _norm(cfg: PropConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, bias=cfg.bias)
    return nn.RMSNorm(cfg.dim, eps=1e-5)


class Attention(nn.Module):
    def __init__(self, cfg: PropConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads  # q heads per kv head: the same on every shard
        self.gqa = cfg.gqa
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.fused = cfg.fused_qkv
        if cfg.fused_qkv:
            self.wqkv = nn.Linear(cfg.dim, q_out + 2 * kv_out, bias=cfg.bias)
        else:
            self.wq = nn.Linear(cfg.dim, q_out, bias=cfg.bias)
            self.wk = nn.Linear(cfg.dim, kv_out, bias=cfg.bias)
            self.wv = nn.Linear(cfg.dim, kv_out, bias=cfg.bias)
        self.wo = nn.Linear(q_out, cfg.dim, bias=cfg.bias)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused:
            return self.wq(x), self.wk(x), self.wv(x)
        qkv = self.wqkv(x)
        if self.group == 1:
            return qkv.chunk(3, -1)
        kv = qkv.shape[-1] // (self.group + 2)  # local kv width, from the tensor
        return qkv.split([self.group * kv, kv, kv], -1)

    def _repeat(self, t: torch.Tensor, rep: int) -> torch.Tensor:
        # t: [b, s, kv_heads, head_dim]
        if self.gqa == "repeat_interleave":
            return t.repeat_interleave(rep, dim=2)
        b, s, kvh, hd = t.shape[0], t.shape[1], t.shape[2], t.shape[3]
        return t[:, :, :, None, :].expand(b, s, kvh, rep, hd).reshape(b, s, kvh * rep, hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        rep = q.shape[2] // k.shape[2]
        k, v = self._repeat(k, rep), self._repeat(v, rep)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: PropConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        dim, hidden = cfg.dim, cfg.hidden
        if cfg.mlp == "gelu":
            self.fc1 = nn.Linear(dim, hidden, bias=cfg.bias)
            self.fc2 = nn.Linear(hidden, dim, bias=cfg.bias)
        elif cfg.mlp == "swiglu":
            self.w1 = nn.Linear(dim, hidden, bias=cfg.bias)
            self.w3 = nn.Linear(dim, hidden, bias=cfg.bias)
            self.w2 = nn.Linear(hidden, dim, bias=cfg.bias)
        else:
            self.gate_up = nn.Linear(dim, 2 * hidden, bias=cfg.bias)
            self.down = nn.Linear(hidden, dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return self.fc2(F.gelu(self.fc1(x)))
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: PropConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class PropTransformer(nn.Module):
    """tokens [b, s] -> logits [b, s, vocab]."""

    def __init__(self, cfg: PropConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(cfg: PropConfig, *, device: str = "cpu", seed: int = 0) -> PropTransformer:
    """The model on ``device``; on CPU its weights depend only on ``cfg`` and ``seed``."""
    if device == "meta":
        with torch.device("meta"):
            return PropTransformer(cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = PropTransformer(cfg)
    with torch.no_grad():
        # embeddings at std dim**-0.5 (not nn.Embedding's 1): tied logits stay O(1), as in real
        # LMs, so an absolute tolerance means the same for tied and untied heads
        for emb in (model.tok, model.pos):
            if emb is not None:
                emb.weight.normal_(0.0, cfg.dim ** -0.5)
        # non-trivial norm weights and biases, so their gradients are checked for real
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def example_ids(cfg: PropConfig, *, batch: int = 2, seq: int = 8, device: str = "meta", seed: int = 0) -> torch.Tensor:
    if device == "meta":
        return torch.zeros(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


_HEADS = (1, 2, 3, 4, 6, 8)
_HEAD_DIMS = (8, 16, 32)
_VOCABS = (64, 96, 100, 128, 200)


def random_config(seed: int) -> PropConfig:
    """A config drawn from ``random.Random(seed)``: width 32-128, depth 1-3, every variant."""
    rng = random.Random(seed)
    while True:
        heads, head_dim = rng.choice(_HEADS), rng.choice(_HEAD_DIMS)
        if 32 <= heads * head_dim <= 128:
            break
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    return PropConfig(
        vocab_size=rng.choice(_VOCABS),
        dim=heads * head_dim,
        n_layers=rng.randint(1, 3),
        n_heads=heads,
        n_kv_heads=kv,
        mlp_ratio=rng.choice((2, 4)),
        norm=rng.choice(("layernorm", "rmsnorm")),
        mlp=rng.choice(("gelu", "swiglu", "swiglu_fused")),
        gqa=rng.choice(("expand", "repeat_interleave")),
        fused_qkv=rng.random() < 0.4,
        bias=rng.random() < 0.5,
        tied=rng.random() < 0.4,
        pos_emb=rng.random() < 0.5,
    )
