"""Attention calls: what one traced call of torch's ``nn.MultiheadAttention`` reads and costs.

Contract
--------
``attention_call(op, graph)`` reads the traced call (the meta fx tracer keeps it as one op,
its arguments as given) into an :class:`AttentionCall`: which of the op's inputs are query,
key and value (the rest are masks, read whole), whether it returns averaged attention
weights, its FLOPs, and the collectives of ``attention_heads`` for an input and output
placement. :mod:`.weights` builds the strategies from it; the style itself lives in
:mod:`shardplan.apply.attention_style`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..analyze.graph import Op, OpGraph
from .placements import Comm, shard_dim

__all__ = ["AttentionCall", "attention_call"]

_PARAMS = list(inspect.signature(nn.MultiheadAttention.forward).parameters)[1:]  # query, key, value, ...
_QKV = ("query", "key", "value")


@dataclass(frozen=True)
class AttentionCall:
    roles: tuple[str, ...]  # per op input: its argument name
    need_weights: bool  # averaged weights returned: one more all-reduce
    splittable: bool  # the call can run split by heads
    batch: int
    tgt_len: int
    src_len: int
    itemsize: int  # of the query, and of the attention weights

    def qkv_values(self, op: Op) -> list[int]:
        """Distinct values read as query, key or value: each one's gradient is summed once."""
        return list(dict.fromkeys(v for v, r in zip(op.inputs, self.roles) if r in _QKV))

    def placements(self, p_in: str) -> tuple[str, ...]:
        return tuple(p_in if r in _QKV else "R" for r in self.roles)

    def shardable(self, graph: OpGraph, op: Op, p: str, tp: int) -> bool:
        d = shard_dim(p)
        return all(len(graph.values[v].shape) > d and graph.values[v].shape[d] % tp == 0 for v in self.qkv_values(op))

    def comms(self, graph: OpGraph, op: Op, p_in: str, p_out: str, out_bytes: int) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
        """(forward, backward) collectives: inputs gathered on entry, the partial output summed
        (all-reduce, or reduce-scatter to ``p_out``), averaged weights all-reduced; backward,
        each input's partial gradient summed (all-reduce, or the gather's reduce-scatter) and a
        sequence-sharded output's gradient all-gathered."""
        inputs = [graph.values[v].nbytes for v in self.qkv_values(op)]
        grads = [graph.values[v].nbytes for v in self.qkv_values(op) if v in graph.requires_grad]
        fwd: list[Comm] = [("all_gather", b) for b in inputs] if p_in != "R" else []
        fwd.append(("all_reduce", out_bytes) if p_out == "R" else ("reduce_scatter", out_bytes))
        if self.need_weights:
            fwd.append(("all_reduce", self.batch * self.tgt_len * self.src_len * self.itemsize))
        bwd: list[Comm] = [("all_gather", out_bytes)] if p_out != "R" else []
        bwd += [("all_reduce" if p_in == "R" else "reduce_scatter", b) for b in grads]
        return tuple(fwd), tuple(bwd)

    def flops(self, module: nn.MultiheadAttention) -> float:
        """Forward + backward (3x): the q, k, v and out projections, then q k^T and the
        weighted sum of v, over every head."""
        e = module.embed_dim
        tq, ts = self.batch * self.tgt_len, self.batch * self.src_len
        proj = 2 * (tq * e * e + ts * e * module.kdim + ts * e * module.vdim + tq * e * e)
        return 3 * (proj + 2 * 2 * self.batch * self.tgt_len * self.src_len * e)


def attention_call(op: Op, graph: OpGraph) -> AttentionCall:
    module = graph.model.get_submodule(op.target)
    roles, args = _roles(op)
    exported = graph.traced.front_end == "export"  # export's leaf node lists inputs, not arguments
    query = graph.values[op.inputs[roles.index("query")]] if "query" in roles else None
    q = query.shape if query is not None else ()
    k = graph.values[op.inputs[roles.index("key")]].shape if "key" in roles else q
    seq_dim = 0 if not module.batch_first or len(q) < 3 else 1
    batch = q[1 - seq_dim] if len(q) == 3 else 1
    need_weights = bool(args.get("need_weights", True))
    return AttentionCall(
        roles=roles, need_weights=need_weights,
        # per-head weights would need every head on every rank
        splittable=not exported and len(roles) == len(op.inputs) and "query" in roles
        and not (need_weights and not args.get("average_attn_weights", True)),
        batch=batch, tgt_len=q[seq_dim] if q else 0,
        # bias_k and add_zero_attn each append one key
        src_len=(k[seq_dim] if k else 0) + (module.bias_k is not None) + module.add_zero_attn,
        itemsize=query.dtype.itemsize if query is not None else 4,
    )


def _roles(op: Op) -> tuple[tuple[str, ...], dict]:
    """The argument name of each tensor input, in the order the op graph lists them (args,
    then kwargs, as ``torch.fx.node.map_arg`` walks them), and the constant arguments."""
    node = op.node
    named = list(zip(_PARAMS, node.args)) + list(node.kwargs.items())
    roles, consts = [], {}
    for name, value in named:
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg(value, found.append)
        roles += [name for n in found if _is_tensor(n)]
        if not found:
            consts[name] = value
    return tuple(roles), consts


def _is_tensor(n: torch.fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor)
