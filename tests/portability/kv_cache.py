"""Attention that keeps a KV cache in its module, as Meta's reference Llama and many
inference-ready research models do: every call writes its keys and values into the cache
at ``start_pos`` and attends over what the cache holds. The ways to hold it: a
non-persistent buffer, a plain tensor attribute moved with ``self.cache_k.to(xq)`` (Meta's
code verbatim), a cache module whose ``update`` writes with ``index_copy_`` and reads it
back by attribute or returns it by a local name (gpt-fast's and torchtune's shape), litgpt's
cache written through a slice of it, and torchtune's own Llama 3 set up for generation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class CachedAttention(nn.Module):
    """``holder``: "buffer" (register_buffer, persistent=False), "attribute" (Meta's
    ``self.cache_k = torch.zeros(...)``, then ``self.cache_k = self.cache_k.to(xq)`` in
    forward), "alias" (a plain attribute written and read through a local name, which the
    tracer cannot follow) or "persistent" (a buffer in the state dict)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_batch: int, max_seq: int, holder: str) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep, self.head_dim, self.holder = n_heads // n_kv_heads, dim // n_heads, holder
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        shape = (max_batch, max_seq, n_kv_heads, self.head_dim)
        if holder in ("attribute", "alias"):
            self.cache_k, self.cache_v = torch.zeros(shape), torch.zeros(shape)
        else:
            self.register_buffer("cache_k", torch.zeros(shape), persistent=holder == "persistent")
            self.register_buffer("cache_v", torch.zeros(shape), persistent=holder == "persistent")

    def forward(self, x, start_pos: int, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if self.holder == "attribute":
            self.cache_k = self.cache_k.to(xq)
            self.cache_v = self.cache_v.to(xq)
        cache_k, cache_v = self.cache_k, self.cache_v  # "alias": a plain attribute read through a local name
        cache_k[:bsz, start_pos: start_pos + seqlen] = xk
        cache_v[:bsz, start_pos: start_pos + seqlen] = xv
        keys = repeat_kv(cache_k[:bsz, : start_pos + seqlen], self.n_rep)
        values = repeat_kv(cache_v[:bsz, : start_pos + seqlen], self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class KVCache(nn.Module):
    """A cache module of buffers, ``[B, kv_heads, S_max, hd]``, written at positions:
    ``index_copy_`` and read back by attribute, or (``returned``, gpt-fast's and torchtune's
    code) written through a local name and returned."""

    def __init__(self, max_batch: int, max_seq: int, n_kv_heads: int, head_dim: int, returned: bool) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq, head_dim)
        self.returned = returned
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("writes", torch.zeros((), dtype=torch.long), persistent=False)

    def update(self, input_pos, k_val, v_val):
        self.writes.add_(1)  # torchtune's ``self.cache_pos.add_(seq_len)``: planning must leave it be
        if self.returned:
            k_out = self.k_cache
            v_out = self.v_cache
            k_out[:, :, input_pos] = k_val
            v_out[:, :, input_pos] = v_val
            return k_out, v_out
        self.k_cache.index_copy_(2, input_pos, k_val)
        self.v_cache.index_copy_(2, input_pos, v_val)
        return self.k_cache[: k_val.shape[0]], self.v_cache[: v_val.shape[0]]


class ModuleCacheAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_batch: int, max_seq: int, returned: bool) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim = n_heads, n_kv_heads, dim // n_heads, dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = KVCache(max_batch, max_seq, n_kv_heads, self.head_dim, returned)

    def forward(self, x, start_pos: int, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_head, self.head_dim)
        k, v = self.wkv(x).view(bsz, seqlen, 2, self.n_local_heads, self.head_dim).unbind(2)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        input_pos = torch.arange(start_pos, start_pos + seqlen, device=x.device)
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k[:, :, : start_pos + seqlen].repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v[:, :, : start_pos + seqlen].repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, attention: nn.Module, dim: int) -> None:
        super().__init__()
        self.attention, self.feed_forward = attention, FeedForward(dim, 4 * dim)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class CachedTransformer(nn.Module):
    def __init__(self, holder: str = "buffer", vocab: int = 256, dim: int = 96, n_layers: int = 2, n_heads: int = 8,
                 n_kv_heads: int = 4, max_batch: int = 4, max_seq: int = 64) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)

        def attention() -> nn.Module:
            if holder in ("module", "returned"):
                return ModuleCacheAttention(dim, n_heads, n_kv_heads, max_batch, max_seq, holder == "returned")
            if holder == "litgpt":
                return LitAttention(dim, n_heads, n_kv_heads, max_batch, max_seq)
            return CachedAttention(dim, n_heads, n_kv_heads, max_batch, max_seq, holder)

        self.layers = nn.ModuleList(TransformerBlock(attention(), dim) for _ in range(n_layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.freqs_cis = precompute_freqs_cis(dim // n_heads, max_seq * 2)

    def forward(self, tokens, start_pos: int = 0):
        bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=tokens.device), diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        return self.output(self.norm(h)).float()


def buffer_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("buffer")


def attribute_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("attribute")


def module_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("module", max_batch=2)  # gpt-fast writes the whole batch: B is max_batch


def returned_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("returned", max_batch=2)


def alias_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("alias")


def persistent_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("persistent")


class LitKVCache(nn.Module):
    """litgpt's cache, as its ``model.py`` writes it: the buffer moved to the keys' dtype, then
    written through a slice of it (``self.k[:n, ...].index_copy_(2, input_pos, k)``)."""

    def __init__(self, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape), persistent=False)

    def forward(self, input_pos, k, v):
        self.k = self.k.to(k.dtype)
        self.v = self.v.to(v.dtype)
        n = k.size(0)
        k = self.k[:n, ...].index_copy_(2, input_pos, k)
        v = self.v[:n, ...].index_copy_(2, input_pos, v)
        return k, v


class LitAttention(nn.Module):
    """litgpt's attention: q/k/v of each query group interleaved in one Linear, split by
    ``qkv.split((q_per_kv, 1, 1), dim=2)`` after a view by groups."""

    def __init__(self, dim: int, n_head: int, n_query_groups: int, max_batch: int, max_seq: int) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, dim // n_head
        self.attn = nn.Linear(dim, (n_head + 2 * n_query_groups) * self.head_size, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        shape = (max_batch, n_query_groups, max_seq, self.head_size)
        self.kv_cache = LitKVCache(shape, shape)

    def forward(self, x, start_pos: int, freqs_cis, mask):
        B, T, C = x.size()
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.attn(x).view(B, T, self.n_query_groups, q_per_kv + 2, self.head_size).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        q, k, v = (t.reshape(B, -1, T, self.head_size) for t in (q, k, v))
        k, v = self.kv_cache(torch.arange(start_pos, start_pos + T, device=x.device), k, v)
        k = k[:, :, : start_pos + T].repeat_interleave(q_per_kv, dim=1)
        v = v[:, :, : start_pos + T].repeat_interleave(q_per_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.head_size * self.n_head))


def litgpt_cache() -> CachedTransformer:
    torch.manual_seed(0)
    return CachedTransformer("litgpt", max_batch=2)


class TorchtuneDecoding(nn.Module):
    """torchtune's Llama 3 with its KV caches set up for generation (``setup_caches``): its
    ``KVCache.update`` writes ``k_out = self.k_cache; k_out[:, :, self.cache_pos[:s]] = k``,
    advances ``self.cache_pos.add_(s)`` and returns ``k_out``. Called here with the causal
    mask and positions generation passes, from the cache's first position."""

    def __init__(self, decoder: nn.Module, max_seq: int) -> None:
        super().__init__()
        self.decoder, self.max_seq = decoder, max_seq

    def forward(self, tokens):
        b, s = tokens.shape
        for layer in self.decoder.layers:  # each call starts a new sequence
            layer.attn.kv_cache.reset()
        mask = torch.tril(torch.ones(s, self.max_seq, dtype=torch.bool, device=tokens.device)).expand(b, s, self.max_seq)
        return self.decoder(tokens, mask=mask, input_pos=torch.arange(s, device=tokens.device).expand(b, s))


def torchtune_decoding(batch: int = 2, max_seq: int = 64) -> TorchtuneDecoding:
    from benchmarks.ecosystem import shim_torchtune

    shim_torchtune()  # stubs for the packages torchtune imports and its model code never calls
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    with torch.device("cpu"):  # its RoPE builds its cache off meta only
        decoder = llama3(vocab_size=256, num_layers=2, num_heads=8, num_kv_heads=4, embed_dim=96, max_seq_len=max_seq,
                         intermediate_dim=256)
        decoder.setup_caches(batch_size=batch, dtype=torch.float32, decoder_max_seq_len=max_seq)
    return TorchtuneDecoding(decoder, max_seq)
