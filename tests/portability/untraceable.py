"""Model code the meta fx tracer cannot follow and torch.export can, written the ways
libraries write it."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class ModuleInForward(Block):
    """Builds a parameter-free module on every call (fx registers it on its root, and the
    planner then looked it up on the user's model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = nn.GELU() if x.shape[-1] > 8 else nn.ReLU()
        return x + self.down(act(self.up(self.norm(x))))


def _resolve(value):
    # a config helper: a callable gives its value on demand (an fx Proxy is callable too)
    return value() if callable(value) else value


class CallableArgument(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _resolve(self.up(self.norm(x)))
        return x + self.down(F.silu(h))


class AutocastByDevice(Block):
    """``torch.autocast(device_type=x.device.type)``: fx hands autocast a proxy, not a string."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = F.gelu(self.up(self.norm(x).float()))
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, kind: type, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(kind(dim) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def module_in_forward() -> Stack:
    torch.manual_seed(0)
    return Stack(ModuleInForward)


def callable_argument() -> Stack:
    torch.manual_seed(0)
    return Stack(CallableArgument)


def autocast_by_device() -> Stack:
    torch.manual_seed(0)
    return Stack(AutocastByDevice)


class ValueBranch(nn.Module):
    """Control flow on a tensor's value: neither front end can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return h if h.sum() > 0 else -h


class GlobalHeads(nn.Module):
    """q viewed by the global head count, k and v by the head dim (as x-transformers does)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.to_q(x).view(b, s, 4, -1).transpose(1, 2)
        k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q * scale, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, s, -1))


class AutocastOffAroundScale(nn.Module):
    """Export only (a callable test), and ``autocast(x.device.type, enabled=False)`` around a
    computation, which torch refuses for the meta device the local check runs on."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GlobalHeads(dim) for _ in range(2))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _resolve(x)
        with torch.autocast(x.device.type, enabled=False):
            scale = torch.ones((), device=x.device)
        for layer in self.layers:
            x = x + layer(x, scale)
        return self.head(x)


def autocast_off_around_scale() -> AutocastOffAroundScale:
    torch.manual_seed(0)
    return AutocastOffAroundScale()


def autocast_off_around_scale_with_inputs() -> tuple[AutocastOffAroundScale, torch.Tensor]:
    return autocast_off_around_scale(), torch.zeros(2, 8, 32)


class DecoderLayer(nn.Module):
    """A Llama-style decoder layer (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP)
    whose code only torch.export follows: a config value resolved by ``callable()``, as
    ``_resolve`` does. Its blocks take the RoPE tables and a flag beside the hidden state."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *, causal: bool = True) -> torch.Tensor:
        b, s, _ = x.shape
        h = _resolve(self.attn_norm(x))
        q = self.wq(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, kv_heads: int = 2, hidden: int = 128,
                 layers: int = 4, max_seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = self.embed(idx)
        rope = (self.cos[:s], self.sin[:s])
        for layer in self.layers:
            x = layer(x, rope, causal=True)
        return self.lm_head(self.norm(x))


def decoder(layers: int = 6) -> Decoder:
    """A small export-only decoder: 6 repeated layers."""
    torch.manual_seed(0)
    return Decoder(layers=layers)


def decoder_70b(layers: int = 80) -> Decoder:
    """Llama-3-70B's shapes (hidden 8192, 64 heads, 8 kv heads, MLP 28672, 80 layers):
    build it on the meta device."""
    return Decoder(vocab=128256, dim=8192, heads=64, kv_heads=8, hidden=28672, layers=layers, max_seq=8192)
