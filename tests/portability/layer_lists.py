"""x-transformers-like (lucidrains' style, einops-free), its layers plain ``ModuleList``s that
forward unpacks and calls one by one (``for norm1, attn, norm2, ff in self.layers``), never
called themselves: Attention with learned memory key/values `mem_kv`
[2, heads, num_mem_kv, dim_head] expanded over batch and concatenated, cosine-sim qk-norm
(F.normalize) with a per-head learned scale, einsum scores/out, GEGLU feedforward with one
projection chunked in two; ScaleNorm; AbsolutePositionalEmbedding."""
import torch, torch.nn as nn, torch.nn.functional as F
from torch import einsum

class ScaleNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1) * (dim ** -0.5))
    def forward(self, x):
        norm = torch.norm(x, dim=-1, keepdim=True)
        return x / norm.clamp(min=self.eps) * self.g

class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)
    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)

class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(GEGLU(dim, inner), nn.Dropout(0.0), nn.Linear(inner, dim))
    def forward(self, x):
        return self.ff(x)

class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, num_mem_kv=2, qk_norm_scale=10.0):
        super().__init__()
        self.heads = heads
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.mem_kv = nn.Parameter(torch.randn(2, heads, num_mem_kv, dim_head))
        self.qk_norm_scale = nn.Parameter(torch.full((1, heads, 1, 1), qk_norm_scale))
        self.to_out = nn.Linear(inner, dim)
    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = map(lambda t: t.reshape(b, n, h, -1).transpose(1, 2), (q, k, v))
        mem_k, mem_v = self.mem_kv.unsqueeze(1).expand(-1, b, -1, -1, -1).unbind(0)
        k = torch.cat((mem_k, k), dim=-2)
        v = torch.cat((mem_v, v), dim=-2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        dots = einsum("b h i d, b h j d -> b h i j", q, k) * self.qk_norm_scale
        i, j = dots.shape[-2:]
        causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
        dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)

class Model(nn.Module):
    def __init__(self, num_tokens=256, dim=64, depth=2, heads=4, dim_head=16, max_seq_len=64):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([ScaleNorm(dim), Attention(dim, dim_head, heads), ScaleNorm(dim), FeedForward(dim)]))
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)
    def forward(self, x):
        n = x.shape[1]
        x = self.token_emb(x) + self.pos_emb(torch.arange(n, device=x.device))
        for norm1, attn, norm2, ff in self.layers:
            x = attn(norm1(x)) + x
            x = ff(norm2(x)) + x
        return self.to_logits(self.norm(x))
