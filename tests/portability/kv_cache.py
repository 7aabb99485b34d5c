"""Attention that keeps a KV cache in its module, as Meta's reference Llama and many
inference-ready research models do: every call writes its keys and values into the cache
at ``start_pos`` and attends over what the cache holds. The ways to hold it: a
non-persistent buffer, a plain tensor attribute moved with ``self.cache_k.to(xq)`` (Meta's
code verbatim), a cache module whose ``update`` writes with ``index_copy_`` and reads it
back by attribute or returns it by a local name (gpt-fast's and torchtune's shape), litgpt's
cache written through a slice of it, and torchtune's own Llama 3 set up for generation; and
fewer kv heads than ranks (2 kv heads at tp=4, one kv head: multi-query attention)."""

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


def grouped_cache() -> CachedTransformer:
    """2 kv heads for 8 query heads: at tp=4 each kv head is read by the query heads of 2 ranks."""
    torch.manual_seed(0)
    return CachedTransformer("buffer", n_kv_heads=2, max_batch=2)


def mqa_cache() -> CachedTransformer:
    """One kv head (multi-query attention), Meta's plain-attribute cache."""
    torch.manual_seed(0)
    return CachedTransformer("attribute", n_kv_heads=1, max_batch=2)


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


def torchtune_grouped() -> TorchtuneDecoding:
    """torchtune's Llama 3 with 2 kv heads for 8 query heads, for tp=4."""
    return torchtune_decoding(kv_heads=2)


def torchtune_decoding(batch: int = 2, max_seq: int = 64, kv_heads: int = 4) -> TorchtuneDecoding:
    from benchmarks.ecosystem import shim_torchtune

    shim_torchtune()  # stubs for the packages torchtune imports and its model code never calls
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    with torch.device("cpu"):  # its RoPE builds its cache off meta only
        decoder = llama3(vocab_size=256, num_layers=2, num_heads=8, num_kv_heads=kv_heads, embed_dim=96, max_seq_len=max_seq,
                         intermediate_dim=256)
        decoder.setup_caches(batch_size=batch, dtype=torch.float32, decoder_max_seq_len=max_seq)
    return TorchtuneDecoding(decoder, max_seq)


# gpt-fast's model.py (pytorch-labs/gpt-fast 32971d3), as it is written: a fused wqkv cut
# into unequal parts, RoPE on a real [seq, hd/2, 2] table, and a KVCache module whose buffers
# are registered persistent (in the state dict), written through a local name and returned.
# Its forward needs ``setup_caches`` first and takes ``input_pos``.


class GptFastKVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.bfloat16):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer('k_cache', torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer('v_cache', torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]

        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val

        return k_out, v_out


class GptFastAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_local_heads: int):
        super().__init__()
        self.head_dim = dim // n_head
        total_head_dim = (n_head + 2 * n_local_heads) * self.head_dim
        self.wqkv = nn.Linear(dim, total_head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = None
        self.n_head, self.n_local_heads, self.dim = n_head, n_local_heads, dim

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape

        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        q = gpt_fast_rotary(q, freqs_cis)
        k = gpt_fast_rotary(k, freqs_cis)

        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        y = self.wo(y)
        return y


class GptFastNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class GptFastBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, n_local_heads: int) -> None:
        super().__init__()
        self.attention = GptFastAttention(dim, n_head, n_local_heads)
        self.feed_forward = FeedForward(dim, 4 * dim)
        self.ffn_norm = GptFastNorm(dim)
        self.attention_norm = GptFastNorm(dim)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


def gpt_fast_freqs(seq_len: int, n_elem: int, base: int = 10000, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def gpt_fast_rotary(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )

    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class GptFastTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 96, n_layer: int = 2, n_head: int = 8, n_local_heads: int = 4,
                 block_size: int = 64) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.dim, self.block_size = n_head, n_local_heads, dim, block_size
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(GptFastBlock(dim, n_head, n_local_heads) for _ in range(n_layer))
        self.norm = GptFastNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.freqs_cis = None
        self.mask_cache = None

    def setup_caches(self, max_batch_size, max_seq_length):
        head_dim = self.dim // self.n_head
        dtype = self.output.weight.dtype
        for b in self.layers:
            b.attention.kv_cache = GptFastKVCache(max_batch_size, max_seq_length, self.n_local_heads, head_dim, dtype)
        self.freqs_cis = gpt_fast_freqs(self.block_size, self.dim // self.n_head, 10000, dtype)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool))

    def forward(self, idx, input_pos=None):
        assert self.freqs_cis is not None, "Caches must be initialized first"
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)

        for i, layer in enumerate(self.layers):
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x)
        logits = self.output(x)
        return logits


class GptFastDecoding(nn.Module):
    """gpt-fast's Transformer after ``setup_caches``, called as its ``prefill`` calls it: the
    tokens of each sequence from position 0."""

    def __init__(self, model: GptFastTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens, torch.arange(tokens.shape[1], device=tokens.device))


def gpt_fast_cache(kv_heads: int = 4) -> GptFastDecoding:
    torch.manual_seed(0)
    model = GptFastTransformer(n_local_heads=kv_heads)
    model.setup_caches(max_batch_size=2, max_seq_length=64)
    return GptFastDecoding(model)


def gpt_fast_grouped() -> GptFastDecoding:
    """2 kv heads for 8 query heads, for tp=4: a persistent cache cannot be held in groups."""
    return gpt_fast_cache(kv_heads=2)
