"""Attention style: torch's ``nn.MultiheadAttention`` split by heads (``attention_heads``).

Contract
--------
``MultiheadAttentionParallel`` is a ``ParallelStyle`` applied by ``parallelize_module`` to
an ``nn.MultiheadAttention`` whose ``num_heads`` tp divides. The module keeps its class,
its parameters' names and its call signature (``(attn_output, attn_weights)``), so model
code, state dicts and checkpoints see the unsharded module; every parameter is a DTensor.

The matrix math, Megatron's attention in one module (W_in = [W_q; W_k; W_v], each [E, E]):

* the in projection is colwise by heads: rank r keeps rows [q_r; k_r; v_r] of the packed
  ``in_proj_weight`` (``packed_placement(parts=3)``, whose global view stays the module's
  own [q; k; v] at every tp, as for a fused gate/up), so ``x @ W_in_r.T`` gives the rank's
  H / tp heads of q, k and v with no collective (separate ``q/k/v_proj_weight``: Shard(0));
* attention runs on those heads alone (heads never mix);
* ``out_proj`` is rowwise: its weight is Shard(1), so the rank's heads times its columns is
  a partial sum of the output. To Replicate that is an all-reduce, to Shard(seq) a
  reduce-scatter. ``out_proj.bias`` is added once, after the sum;
* the inputs are read whole, so their gradients are partial sums (each rank back-propagates
  its own heads): all-reduced (or, for an input that arrived sequence-sharded and was
  all-gathered here, reduce-scattered) once per distinct input tensor;
* averaged attention weights (``need_weights=True``) are each rank's heads' share of the
  mean: one more all-reduce.

``torch.nn.functional.multi_head_attention_forward`` sizes heads by the input's full width,
so it cannot run on the rank's heads: :func:`local_attention` is its computation on the
rank's H / tp heads, masks included (a per-head 3-D mask is cut to the rank's heads).
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from .styles import _ScaleForward, _restore_params, _swap_to_local, packed_placement

__all__ = ["MultiheadAttentionParallel", "local_attention", "mha_arguments"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def mha_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in (``need_weights`` is True unless given)."""
    bound = _SIGNATURE.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "self"}


class MultiheadAttentionParallel(ParallelStyle):
    """``attention_heads``: see the module docstring. ``input_layouts``: how query, key and
    value arrive (Replicate, or Shard(seq) under sequence parallel, all-gathered here);
    ``output_layouts``: Replicate (all-reduce) or Shard(seq) (reduce-scatter)."""

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        if not isinstance(module, nn.MultiheadAttention) or module.num_heads % tp:
            raise ValueError(f"attention_heads applies to an nn.MultiheadAttention whose num_heads tp={tp} divides; "
                             f"got {type(module).__name__} with {getattr(module, 'num_heads', None)} heads: "
                             "use replicate for it, or a tp that divides its heads")
        split = {name: _placement(name) for name, _ in module.named_parameters()}
        for path, where in split.items():
            owner, name = (module.out_proj, path.split(".")[1]) if path.startswith("out_proj.") else (module, path)
            p = owner._parameters[name]
            dist = distribute_tensor(p.detach(), device_mesh, [where], src_data_rank=self.src_data_rank)
            owner.register_parameter(name, nn.Parameter(dist, requires_grad=p.requires_grad))
        module.forward = partial(_forward, module, mesh=device_mesh, input_layout=self.input_layouts,
                                 output_layout=self.output_layouts, names=tuple(split))
        return module


def _placement(name: str) -> Any:
    if name in ("in_proj_weight", "in_proj_bias"):
        return packed_placement(parts=3, dim=0)  # [q_r; k_r; v_r]: the rank's heads of each
    if name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return Shard(0)
    if name in ("bias_k", "bias_v"):  # [1, 1, E], appended to k / v: split by heads as they are
        return Shard(2)
    return Shard(1) if name == "out_proj.weight" else Replicate()  # out_proj.bias: added after the sum


def _forward(module: nn.MultiheadAttention, *args, mesh, input_layout, output_layout, names, **kwargs):
    call = mha_arguments(args, kwargs)
    tp = mesh.size()
    _swap_to_local(module, (), names=names)
    try:
        # one local tensor per distinct input: self-attention's x, x, x is all-reduced once
        seen: dict[int, torch.Tensor] = {}
        for role in ("query", "key", "value"):
            x = call[role]
            if id(x) not in seen:
                seen[id(x)] = _whole_with_partial_grad(x, mesh, input_layout)
            call[role] = seen[id(x)]
        out, weights = local_attention(module, tp=tp, rank=mesh.get_local_rank(), **call)
        if module.out_proj.bias is not None:  # bias / tp on each rank: the sum adds it once
            out = out + _ScaleForward.apply(module.out_proj.bias, 1.0 / tp)
    finally:
        _restore_params(module, (), None)
    out = DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [output_layout]).to_local()
    if weights is not None:  # each rank's heads' share of the mean over all heads
        weights = DTensor.from_local(weights, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    return out, weights


def _whole_with_partial_grad(x: torch.Tensor, mesh: Any, layout: Any) -> torch.Tensor:
    """The input whole on every rank; its gradient, this rank's heads' share, summed across
    ranks (Replicate -> all-reduce; arrived Shard(seq) -> the gather's reduce-scatter)."""
    dx = DTensor.from_local(x, mesh, [layout], run_check=False)
    if not layout.is_replicate():
        dx = dx.redistribute(mesh, [Replicate()])
    return dx.to_local(grad_placements=(Partial(),))


def local_attention(module: nn.MultiheadAttention, *, tp: int, rank: int, query, key, value, key_padding_mask=None,
                    need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
    """``nn.MultiheadAttention.forward`` on this rank's ``num_heads / tp`` heads, from the
    local shards of its parameters, without the out projection's bias: the output is this
    rank's partial sum, and averaged weights its heads' share of the mean."""
    if module.batch_first and query.dim() == 3:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
    if need_weights and not average_attn_weights:
        raise ValueError("attention_heads: per-head attention weights (average_attn_weights=False) would need "
                         "every head on every rank; pass average_attn_weights=True or keep this module replicate")
    tgt_len, bsz, _ = query.shape
    heads, head_dim = module.num_heads // tp, module.head_dim
    kpm, attn_mask, is_causal = _masks(key_padding_mask, attn_mask, is_causal, need_weights, query.dtype)
    q, k, v = _project(module, query, key, value)
    attn_mask = _heads_of_mask(attn_mask, bsz, module.num_heads, heads, rank)
    if module.bias_k is not None:
        k = torch.cat([k, module.bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, module.bias_v.repeat(1, bsz, 1)])
        attn_mask, kpm = _pad(attn_mask), _pad(kpm)
    q, k, v = (t.reshape(t.shape[0], bsz * heads, head_dim).transpose(0, 1) for t in (q, k, v))
    if module.add_zero_attn:
        zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask, kpm = _pad(attn_mask), _pad(kpm)
    src_len = k.size(1)
    if kpm is not None:
        kpm = kpm.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    dropout_p = module.dropout if module.training else 0.0
    out, weights = _attend(q, k, v, attn_mask, dropout_p, is_causal, need_weights, bsz=bsz, heads=heads)
    out = F.linear(out.reshape(tgt_len * bsz, heads * head_dim), module.out_proj.weight).view(tgt_len, bsz, -1)
    if weights is not None:  # this rank's heads' sum over the mean's denominator, all heads
        weights = weights.view(bsz, heads, tgt_len, src_len).sum(dim=1) / module.num_heads
        weights = weights if batched else weights.squeeze(0)
    if not batched:
        out = out.squeeze(1)
    elif module.batch_first:
        out = out.transpose(0, 1)
    return out, weights


def _masks(kpm, attn_mask, is_causal, need_weights, dtype):
    """torch's mask rules (``multi_head_attention_forward``): float masks, the causal hint
    kept only where SDPA can take it alone."""
    kpm = F._canonical_mask(mask=kpm, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
                            other_name="attn_mask", target_type=dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (nn.MultiheadAttention's own rule)")
    if is_causal and kpm is None and not need_weights:
        return kpm, None, True
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=dtype, check_other=False)
    return kpm, attn_mask, is_causal and kpm is None


def _project(module: nn.MultiheadAttention, query, key, value):
    """q, k, v of the rank's heads: its rows [q_r; k_r; v_r] of the packed projection."""
    bias = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else (None, None, None)
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, bias))


def _heads_of_mask(mask, bsz: int, num_heads: int, heads: int, rank: int):
    """A 2-D mask is shared by all heads; a 3-D one is [bsz * num_heads, L, S]: keep this
    rank's heads."""
    if mask is None or mask.dim() == 2:
        return None if mask is None else mask.unsqueeze(0)
    per_head = mask.view(bsz, num_heads, *mask.shape[1:])
    return per_head[:, rank * heads:(rank + 1) * heads].reshape(bsz * heads, *mask.shape[1:])


def _pad(mask):
    return None if mask is None else F.pad(mask, (0, 1))


def _attend(q, k, v, attn_mask, dropout_p, is_causal, need_weights, *, bsz, heads):
    """[bsz * heads, L, head_dim] -> ([L * bsz, heads * head_dim] ordered as torch's, weights)."""
    head_dim = q.shape[2]
    if need_weights:
        scores = q * math.sqrt(1.0 / float(head_dim)) @ k.transpose(-2, -1)
        weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, dim=-1)
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
        out = torch.bmm(dropped, v).transpose(0, 1).contiguous()
        return out, dropped
    if attn_mask is not None:
        attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(bsz, heads, -1, attn_mask.size(-1))
    q, k, v = (t.view(bsz, heads, -1, head_dim) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    return out.permute(2, 0, 1, 3).contiguous(), None
