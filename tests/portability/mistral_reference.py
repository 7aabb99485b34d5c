"""mistral-inference's style: a ModelArgs dataclass, layers in an ``nn.ModuleDict`` keyed by
``str(i)``, the block calling ``self.attention.forward(...)`` directly, ``[B, T, H, D]``
layout with ``repeat_kv`` by ``torch.repeat_interleave(..., dim=2)``, complex ``freqs_cis``
with ``view_as_complex``, SDPA with an explicit causal additive mask, 2 kv heads, FeedForward
w1/w2/w3."""
from dataclasses import dataclass
import torch, torch.nn as nn, torch.nn.functional as F

@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 256
    rope_theta: float = 10000.0

def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)

def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)

def repeat_kv(keys, values, repeats, dim):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight

class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.n_kv_heads = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = args.head_dim ** -0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, val = repeat_kv(xk, xv, self.repeats, dim=2)
        xq, key, val = xq.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, key, val, attn_mask=mask, scale=self.scale)
        output = output.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return self.wo(output)

class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
    def forward(self, x, freqs_cis, mask):
        r = self.attention.forward(self.attention_norm(x), freqs_cis, mask)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        return h + r

class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self._precomputed_freqs_cis = None
    @property
    def freqs_cis(self):
        if self._precomputed_freqs_cis is None:
            self._precomputed_freqs_cis = precompute_freqs_cis(self.args.head_dim, 128, self.args.rope_theta)
        return self._precomputed_freqs_cis
    def forward(self, input_ids):
        seqlen = input_ids.shape[1]
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[:seqlen].to(device=h.device)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=h.device).triu(1)
        for i in range(self.args.n_layers):
            h = self.layers[str(i)](h, freqs_cis, mask)
        return self.output(self.norm(h)).float()

def Model(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, hidden_dim=128):
    return Transformer(ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                 head_dim=head_dim, vocab_size=vocab_size, hidden_dim=hidden_dim))
