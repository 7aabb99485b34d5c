"""Fused q/k/v projections written the common ways, each split downstream by another op:
``split(width)`` by a width attribute (nanoGPT), equal slices ``qkv[..., :q_pos]`` (phi3),
``reshape(B, N, 3, heads, head_dim)`` with the parts unbound (timm's ViT), and
``split([q, kv, kv])`` of a GQA projection. Head counts and widths are integer attributes,
as research code keeps them."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.portability.lm import PreNormBlock, TokenLM


class _Fused(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.n_embd = dim
        self.q_pos = heads * self.head_dim
        self.kv_width = self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(dim, self.q_pos + 2 * self.kv_width)
        self.proj = nn.Linear(dim, dim)

    def _attend(self, q, k, v, b, s):
        # q, k, v: [b, heads, s, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.n_embd))

    def _heads(self, t, b, s, n):
        return t.view(b, s, n, self.head_dim).transpose(1, 2)


class SplitByWidth(_Fused):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        return self._attend(*(self._heads(t, b, s, self.n_head) for t in (q, k, v)), b, s)


class EqualSlices(_Fused):
    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q = qkv[..., : self.q_pos]
        k = qkv[..., self.q_pos: self.q_pos + self.kv_width]
        v = qkv[..., self.q_pos + self.kv_width:]
        return self._attend(*(self._heads(t, b, s, self.n_head) for t in (q, k, v)), b, s)


class ReshapeThree(_Fused):
    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return self._attend(q, k, v, b, s)


class SplitGQA(_Fused):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.q_pos, self.kv_width, self.kv_width], dim=-1)
        return self._attend(self._heads(q, b, s, self.n_head), self._heads(k, b, s, self.n_kv_head),
                            self._heads(v, b, s, self.n_kv_head), b, s)


class GroupedPerKV(_Fused):
    """Megatron's layout: the rows are grouped per kv head, ``[q_0 .. q_{g-1}, k, v]`` for
    each, so a plain colwise split hands each rank whole groups."""

    def forward(self, x):
        b, s, _ = x.shape
        group = self.n_head // self.n_kv_head
        qkv = self.qkv(x).view(b, s, self.n_kv_head, group + 2, self.head_dim)
        q = qkv[:, :, :, :group].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k, v = (qkv[:, :, :, i].transpose(1, 2) for i in (group, group + 1))
        return self._attend(q, k, v, b, s)


class EinopsThree(_Fused):
    """lucidrains-style: ``rearrange(qkv, 'b n (three h d) -> three b h n d', h=self.n_head)``.
    einops defeats the fx tracer, so the export front end traces it; the head count is made
    local as for hand-written views."""

    def forward(self, x):
        from einops import rearrange

        b, s, _ = x.shape
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.n_head)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


def _lm(cls, *, heads: int = 8, kv_heads: int | None = None, dim: int = 64, layers: int = 2) -> TokenLM:
    return TokenLM([PreNormBlock(cls(dim, heads, kv_heads), dim) for _ in range(layers)], dim=dim, vocab=128)


def split_by_width() -> TokenLM:
    return _lm(SplitByWidth)


def equal_slices() -> TokenLM:
    return _lm(EqualSlices)


def reshape_three() -> TokenLM:
    return _lm(ReshapeThree)


def split_gqa() -> TokenLM:
    return _lm(SplitGQA, kv_heads=4)


def einops_three() -> TokenLM:
    return _lm(EinopsThree)


def grouped_per_kv() -> TokenLM:
    return _lm(GroupedPerKV, kv_heads=4)


def phi3_equal_heads() -> nn.Module:
    """Hugging Face's Phi-3 at a tiny size with as many kv heads as query heads: its fused
    ``qkv_proj`` is sliced into three equal parts by ``self.config.num_attention_heads``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    return Phi3ForCausalLM(config)


class ParallelBlock(nn.Module):
    """GPT-J/PaLM's parallel residual, ``x + attn(ln(x)) + mlp(ln(x))``: one norm's output
    feeds the nanoGPT attention and the MLP, so under sequence parallelism it is gathered once,
    at the norm's output, for both."""

    def __init__(self, dim: int = 64, heads: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = SplitByWidth(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.down(F.gelu(self.up(h)))


def parallel_blocks() -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([ParallelBlock() for _ in range(2)], dim=64, vocab=128)


class CastParallelBlock(ParallelBlock):
    """The same, its MLP's output moved to the norm's device (``.to(h.device)``, as code
    written for several devices does): a read of the norm's output for its device alone."""

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.down(F.gelu(self.up(h))).to(h.device)


def cast_parallel_blocks() -> TokenLM:
    torch.manual_seed(0)
    return TokenLM([CastParallelBlock() for _ in range(2)], dim=64, vocab=128)
