"""Weight-module strategies: the tensor-parallel styles a Linear, Embedding or norm can take.

Contract
--------
``module_strategies(op, graph, tp=...)`` lists the styles valid for the module called by
``op`` (divisibility checked on the real weight shapes), each with the collectives that
style performs and the per-device parameter bytes and FLOPs. Style names are Hugging
Face's ``tp_plan`` vocabulary. ``layouts["weight"]`` is the placement of the weight tensor
(used to keep tied weights consistent), ``layouts["input"]``/``["output"]`` the layouts the
emitter passes to the torch style.

The matrix math (Linear computes y = x @ W.T, W is [out, in]):

* colwise: W sharded on rows (Shard(0)); x Replicate; y = x @ W_local.T is the local slice
  of the output features (Shard(-1)). No forward collective; backward dx = dy @ W sums over
  the sharded out features: Partial, all-reduced once per region.
* rowwise: W sharded on columns (Shard(1)); x arrives Shard(-1); y_local = x_local @
  W_local.T is a partial sum: to Replicate is an all-reduce, to Shard(seq) a reduce-scatter.
* colwise_gather_output: colwise, then all-gather the output features (a head whose
  logits the user needs whole).
* embedding_rowwise (vocab parallel): the table is sharded on the vocabulary (Shard(0));
  each rank looks up the ids it owns and zeros the rest: a Partial sum, all-reduced.
* packed_colwise: a fused projection whose output is cut into ``k`` equal parts (gate and
  up by ``chunk(2)``; q/k/v by ``split(width)``, slices, a ``(3, heads, head_dim)`` view):
  each rank keeps its slice of every part, so the local cuts are the parts' local slices.
  A contiguous split would hand rank 0 the whole gate and rank 1 the up.
* packed_colwise with whole_parts: [Q; K; V] with fewer kv heads than ranks (MQA's one):
  each part split tp ways at rest, so rank r computes [q_r, k_r, v_r]; k and v are then
  all-gathered over the ranks of their kv head, so [q_r, k_g, v_g] (:mod:`.tails`).
* rowwise_split_input: rowwise on an input that arrives whole; each rank slices its
  features locally, and backward all-gathers the sliced input gradient.
* colwise_kv_replicated: fewer kv heads than tp (Megatron's and vLLM's answer). The k/v
  weight is cut into ``n`` groups of rows, one per kv head, and each group is held by the
  ``tp / n`` ranks whose query heads read that kv head (placed ``[Shard(0), Replicate()]``
  on the tp axis unflattened to ``(n, tp / n)``). Forward is colwise on that group; each
  rank back-propagates only its own query heads' share, so the weight gradient is Partial
  over the group's ``tp / n`` ranks (all-reduced when backward ends) and the input gradient
  Partial over all tp ranks, summed with the q projection's by the region's all-reduce.
* colwise_kv_gathered: the same kv head on the same ranks, from a weight split 1/tp
  (plain Shard(0): the ``tp / n`` ranks of a group hold consecutive slices of its kv head's
  rows). Each computes its slice, and an all-gather across the group makes the head whole;
  backward, the group's partial output gradients are summed and scattered back by a
  reduce-scatter, so the weight gradient is complete. Every weight stays split tp ways (the
  default plan's choice); colwise_kv_replicated trades tp / n times the k/v weight for no
  forward collective, within a memory budget.
* sequence_parallel (norms): the activation is sharded on the sequence; the norm is
  per-token so it runs locally, but its weight gradient sums over tokens: Partial,
  all-reduced once per step. replicated_with_grad_allreduce is the same for a norm whose
  input is sharded on heads (Qwen3's q_norm/k_norm).
* Hugging Face's Conv1D stores W as [in, out]: each style splits the other weight dim.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..analyze.graph import Op, OpGraph
from ..analyze.graph import module_kind as module_kind_of
from .heads import (
    grouped_values, kv_replicated_strategies, partial_grad_linear_strategies, under_partial_grad_owner, viewed_heads,
)
from .packing import packed_into, unequal_parts
from .folded import folded_module_twins, folded_values
from .tails import tailed_colwise
from .elementwise import scalar_elementwise_dims
from .functional import functional_strategies
from .listed import listed_strategies
from .banks import bank_call
from .placements import Strategy, group_counts, grouped, packed, seq_dims

__all__ = ["module_strategies", "STYLE_NAMES"]

STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_kv_replicated",
    "colwise_kv_gathered",
    "packed_colwise",
    "rowwise_split_input",
    "embedding_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "moe_tp_experts",
    "attention_heads",
    "dtensor_weights",
    "listed_heads",
    "replicate",
)


# a weight module's parameters, its children's included: nn.MultiheadAttention's ``out_proj``
# (read by its own call), a listed-heads module's heads and projection
def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() >= 2)


def module_strategies(op: Op, graph: OpGraph, *, tp: int, opts: Any = None) -> list[Strategy]:
    module = graph.model.get_submodule(op.target)
    sp_opt = getattr(opts, "sequence_parallel", None)
    sp = sp_opt is not False
    kind = op.module_kind
    if kind in ("linear", "conv1d") and len(op.inputs) == 1:
        found = _linear(op, graph, module, tp, sp)
        found += folded_module_twins(op, graph, tp, found) if sp and kind == "linear" else []
    elif kind == "embedding" and len(op.inputs) <= 1:  # none: a table that makes its positions from a shape
        found = _embedding(op, graph, module, tp, sp)
    elif kind == "norm" and len(op.inputs) == 1 and _acts_like_norm(op, graph, module):
        found = _norm(op, graph, module, tp, sp)
        if sp_opt is True and any(s.name != "replicate" for s in found):  # the user asked for sequence parallel norms
            # a norm over all heads (OLMo 2's q_norm) may still hand on each rank's heads: its
            # input is a projection's output, not the residual stream sequence parallel splits
            projected = _producer(graph, op).kind == "module"
            found = [replace(s, off_sequence=s.name == "replicate" and not (projected and s.output != "R"))
                     for s in found]
    elif kind == "experts":
        found = _experts(op, graph, module, tp, sp)
    elif kind == "attention":
        found = _attention(op, graph, module, tp, sp)
    elif kind == "listed_heads":
        listed, flops = listed_strategies(op, graph, module, tp, sp)
        found = [_replicate(op, graph, module, flops)] + listed
    elif kind == "other" and (functional := functional_strategies(op, graph, module, tp, sp))[1]:
        # its own code reads its weights in products (F.linear(x, self.wq)): run on DTensors
        found = [_replicate(op, graph, module, functional[1])] + functional[0]
    elif dims := scalar_elementwise_dims(op, graph, tp):
        found = [_replicate(op, graph, module)] + [_on_shards(op, graph, module, d, tp) for d in dims]
    else:
        # whole on every rank; under sequence parallel it may hand on its rank's slice of the
        # sequence (a positional-embedding module called with more than ids, OPT's and BART's)
        one = isinstance(op.node.meta.get("val"), torch.Tensor)  # a tuple it returns is not sliced
        found = [_replicate(op, graph, module)] + (_sliced_replicate(op, graph, module, tp) if sp and one else [])
    full = _weight_bytes(module)
    return [replace(s, weight_bytes=_held(full, s, tp)) for s in found]


def _held(full: int, s: Strategy, tp: int) -> float:
    """Weight bytes a device holds under ``s``: whole, 1/tp, or 1/groups with kv heads
    replicated in groups. The default plan holds the fewest (a user who asks for tp=8 wants
    the model split 8 ways): replicating kv heads for speed is chosen within a memory budget."""
    if "held" in s.layouts:  # dtensor_weights: its split and whole parameters counted one by one
        return s.layouts["held"]
    if s.layouts.get("weight", "R") == "R":
        return full
    return full / (s.layouts["groups"] if s.name == "colwise_kv_replicated" else tp)


def read_elsewhere(graph: OpGraph) -> frozenset[str]:
    """Weight modules whose parameter other code reads as an attribute and computes with
    (torchtune's ``TiedLinear``: ``F.linear(x, self.tied_module.weight)`` in a plain object):
    a sharded weight would reach that code as a DTensor beside plain tensors. Reads for
    metadata only (``self.wo.weight.dtype``) do not count."""
    cached = graph.strategy_cache.get("read_elsewhere")
    if cached is None:
        from .propagation import metadata_only

        leaves = {op.target for op in graph.ops if op.kind in ("module", "folded")}
        found = set()
        for op in graph.ops:
            owner = op.target.rpartition(".")[0] if op.kind == "const" else None
            if owner in leaves and any(not metadata_only(graph.ops[c]) for c in graph.consumers.get(op.output, [])):
                found.add(owner)
        cached = graph.strategy_cache["read_elsewhere"] = frozenset(found)
    return cached


def _acts_like_norm(op: Op, graph: OpGraph, module: nn.Module) -> bool:
    """Per-token over the last dim: output shaped as input, parameters sized to the last dim."""
    x, y = graph.values[op.inputs[0]], graph.values[op.output] if op.output is not None else None
    sizes = {p.shape[0] for p in module.parameters(recurse=False)}
    return y is not None and x.shape == y.shape and sizes == {x.shape[-1]}


def _replicate(op: Op, graph: OpGraph, module: nn.Module, flops: float = 0.0) -> Strategy:
    out = graph.values[op.output].nbytes if op.output is not None else 0
    return Strategy(
        "replicate", tuple("R" for _ in op.inputs), "R" if op.output is not None else None,
        param_bytes=_param_bytes(module), flops=flops, act_bytes=out, layouts={"weight": "R"},
    )


def _on_shards(op: Op, graph: OpGraph, module: nn.Module, d: int, tp: int, *,
               name: str = "replicated_with_grad_allreduce") -> Strategy:
    """A module that acts per entry or per token (an elementwise module with scalar
    parameters, :mod:`.elementwise`; a norm) on a shard of dim ``d``: its parameters whole,
    their gradients partial sums over each rank's entries."""
    x = graph.values[op.inputs[0]]
    return Strategy(
        name, (f"S{d}",), f"S{d}", bwd=_param_grad_allreduces(module),
        param_bytes=_param_bytes(module), mem_bytes=2 * x.nbytes / tp, act_bytes=x.nbytes / tp,
        layouts={"weight": "R", "input": f"S{d}"},
    )


def _features(module: nn.Module) -> tuple[int, int, str, str]:
    """(in, out, colwise weight placement, rowwise weight placement).

    nn.Linear stores W as [out, in]; HF's Conv1D as [in, out] (y = x @ W + b), so the same
    style splits the other weight dim."""
    w = module.weight
    if module_kind_of(module) == "conv1d":
        return w.shape[0], w.shape[1], "S1", "S0"
    return w.shape[1], w.shape[0], "S0", "S1"


def _linear(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool) -> list[Strategy]:
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    n_in, n_out, col_w, row_w = _features(module)
    tokens = x.nbytes // max(x.shape[-1], 1) // x.dtype.itemsize if x.shape else 0
    flops = 3 * 2 * tokens * n_in * n_out  # forward, dx and dW
    pbytes = _param_bytes(module)
    last = len(y.shape) - 1
    out: list[Strategy] = [_replicate(op, graph, module, flops)]
    col = dict(param_bytes=_ceil_div_bytes(pbytes, n_out, tp), flops=flops / tp, act_bytes=y.nbytes / tp)
    # gathering right away tolerates an uneven split (a 50257-token head); sharded outputs do
    # not, and fewer features than ranks (qwen2_moe's 1-row shared_expert_gate) leave ranks empty
    gathered = _padded_bytes(y.nbytes, n_out, tp)
    if n_out >= tp:
        out.append(Strategy(
            "colwise_gather_output", ("R",), "R", fwd=(("all_gather", gathered),), entry=("R",),
            layouts={"weight": col_w, "output": "R"}, **col,
        ))
    for d in seq_dims(x.shape, tp) if sp and n_out >= tp else []:
        out.append(Strategy(
            "colwise_gather_output", (f"S{d}",), "R", fwd=(("all_gather", gathered),), entry=(f"S{d}",),
            layouts={"weight": col_w, "input": f"S{d}", "output": "R"}, **col,
        ))
    if n_out % tp == 0:
        out.append(Strategy("colwise", ("R",), f"S{last}", entry=("R",), layouts={"weight": col_w}, **col))
        for d in seq_dims(x.shape, tp) if sp else []:
            out.append(Strategy(
                "colwise", (f"S{d}",), f"S{last}", entry=(f"S{d}",), layouts={"weight": col_w, "input": f"S{d}"}, **col,
            ))
    k = packed_into(op, graph)
    parts: int | list[int] | None = k if k and n_out % (k * tp) == 0 else None
    if parts is None and module_kind_of(module) == "linear":
        parts = unequal_parts(op, graph, tp)
    if parts and module_kind_of(module) in ("linear", "conv1d"):
        # the output features are weight dim 0 of nn.Linear ([out, in]), dim 1 of HF's Conv1D;
        # unequal parts (GQA's [Q; K; V]) are placed PackedShard, rank r holding [q_r; k_r; v_r]
        n = parts if isinstance(parts, int) else len(parts)
        w = f"{col_w}p{n}"
        out.append(Strategy(
            "packed_colwise", ("R",), packed(last, n), entry=("R",), layouts={"weight": w, "packed": parts}, **col,
        ))
        for d in seq_dims(x.shape, tp) if sp else []:  # a sequence-sharded input is all-gathered on entry
            out.append(Strategy(
                "packed_colwise", (f"S{d}",), packed(last, n), entry=(f"S{d}",),
                layouts={"weight": w, "packed": parts, "input": f"S{d}"}, **col,
            ))
    # k and v of fewer heads than ranks fused after the query heads: gathered where read
    seq_in = [f"S{d}" for d in seq_dims(x.shape, tp)] if sp else []
    out += tailed_colwise(op, graph, tp, weight=col_w, inputs=["R", *seq_in], common=col)
    if n_in % tp == 0:
        out += _rowwise(x, y, module, pbytes, flops, tp, sp, row_w)
    if module_kind_of(module) == "linear":
        seq = seq_dims(x.shape, tp) if sp else []
        out += kv_replicated_strategies(y, module, pbytes, flops, tp, heads=viewed_heads(op, graph, tp), seq_dims=seq)
    if under_partial_grad_owner(op.target.rpartition(".")[0], graph, tp) and module_kind_of(module) == "linear":
        out += partial_grad_linear_strategies(y, tp, col_w, col, n_out=n_out, pbytes=pbytes, flops=flops,
                                              grad_allreduces=_param_grad_allreduces(module),
                                              seq=seq_dims(x.shape, tp) if sp else [])
    return out


def _padded_bytes(total: int, dim: int, tp: int) -> float:
    """Bytes an all-gather of a value split unevenly on ``dim`` moves: DTensor pads every
    shard to the largest (a 50257-token head at tp=2 gathers 50258 columns), then unpads."""
    return tp * _ceil_div_bytes(total, dim, tp)


def _ceil_div_bytes(total: int, dim: int, tp: int) -> float:
    """Bytes of the largest shard when ``dim`` splits unevenly (torch gives the remainder to the last)."""
    return total * (-(-dim // tp)) / dim


def _rowwise(x, y, module: nn.Module, pbytes: int, flops: float, tp: int, sp: bool, row_w: str) -> list[Strategy]:
    bias = module.bias.numel() * module.bias.element_size() if getattr(module, "bias", None) is not None else 0
    row = dict(param_bytes=(pbytes - bias) / tp + bias, flops=flops / tp)
    in_shard = f"S{len(x.shape) - 1}"
    out = [Strategy("rowwise", (in_shard,), "R", fwd=(("all_reduce", y.nbytes),), act_bytes=y.nbytes, layouts={"weight": row_w}, **row)]
    # input arrives whole (e.g. after a gathered fused qkv): each rank keeps its slice of the
    # features; backward all-gathers the sliced input gradient
    out.append(Strategy(
        "rowwise_split_input", ("R",), "R", fwd=(("all_reduce", y.nbytes),), bwd=(("all_gather", x.nbytes),),
        act_bytes=y.nbytes, layouts={"weight": row_w, "input": "R"}, **row,
    ))
    if sp:
        # the partial sums left as they are, a local tensor on each rank: summed with other
        # partial sums (a MoE block's routed experts) and reduce-scattered once where the
        # block returns (:mod:`.scatter`); backward, each rank receives the whole gradient
        out.append(Strategy("rowwise", (in_shard,), "P", act_bytes=y.nbytes, layouts={"weight": row_w, "output": "P"}, **row))
    for d in seq_dims(y.shape, tp) if sp else []:
        out.append(Strategy(
            "rowwise", (in_shard,), f"S{d}", fwd=(("reduce_scatter", y.nbytes),), bwd=(("all_gather", y.nbytes),),
            act_bytes=y.nbytes / tp, layouts={"weight": row_w, "output": f"S{d}"}, **row,
        ))
        # after a block that ran whole (heads tp does not divide), back onto sequence shards
        out.append(Strategy(
            "rowwise_split_input", ("R",), f"S{d}", fwd=(("reduce_scatter", y.nbytes),),
            bwd=(("all_gather", y.nbytes), ("all_gather", x.nbytes)), act_bytes=y.nbytes / tp,
            layouts={"weight": row_w, "input": "R", "output": f"S{d}"}, **row,
        ))
    return out


def _embedding(op: Op, graph: OpGraph, module: nn.Embedding, tp: int, sp: bool) -> list[Strategy]:
    y = graph.values[op.output]
    pbytes = _param_bytes(module)
    last = len(y.shape) - 1
    out: list[Strategy] = [_replicate(op, graph, module)]
    # a table whose forward makes its own positions from a shape (LED's, BART's learned
    # positions: ``forward(input_ids_shape)``) has no tensor input; vocab-parallel finds the
    # lookup inside forward, while torch's colwise style needs a tensor to wrap
    ins = tuple("R" for _ in op.inputs)
    vocab_shard = _ceil_div_bytes(pbytes, module.num_embeddings, tp)  # uneven vocabularies split too
    if module.num_embeddings >= tp:  # not fewer rows than ranks (roberta's 2 token types)
        out.append(Strategy(
            "embedding_rowwise", ins, "R", fwd=(("all_reduce", y.nbytes),),
            param_bytes=vocab_shard, act_bytes=y.nbytes, layouts={"weight": "S0"},
        ))
    if module.num_embeddings >= tp:  # the reduce-scatter cuts the sequence: an uneven vocabulary splits too
        for d in seq_dims(y.shape, tp) if sp else []:
            out.append(Strategy(
                "embedding_rowwise", ins, f"S{d}", fwd=(("reduce_scatter", y.nbytes),), bwd=(("all_gather", y.nbytes),),
                param_bytes=vocab_shard, act_bytes=y.nbytes / tp, layouts={"weight": "S0", "output": f"S{d}"},
            ))
    if module.embedding_dim % tp == 0 and ins:
        out.append(Strategy("colwise", ins, f"S{last}", param_bytes=pbytes / tp, act_bytes=y.nbytes / tp, layouts={"weight": "S1"}))
        # its features gathered where it returns: a table with fewer rows than ranks (BERT's 2
        # token types at tp=4) added to the vocabulary-parallel tokens, whose features split
        # tp ways would otherwise carry the split down the whole residual stream (q/k/v rowwise,
        # every attention whole). Backward slices the whole gradient: no collective. Not for a
        # table with its own forward (Muse Spark's norm after the lookup would run on split
        # features), nor where the vocabulary can be split (torchtitan's and Hugging Face's
        # layout, which Hugging Face's tp_plan can state)
        if module.num_embeddings < tp and type(module).forward is nn.Embedding.forward:
            out.append(Strategy("colwise_gather_output", ins, "R", fwd=(("all_gather", _padded_bytes(y.nbytes, module.embedding_dim, tp)),), param_bytes=pbytes / tp,
                                act_bytes=y.nbytes, layouts={"weight": "S1"}))
    out += _sliced_replicate(op, graph, module, tp) if sp else []
    return out


def _sliced_replicate(op: Op, graph: OpGraph, module: nn.Module, tp: int) -> list[Strategy]:
    """A replicated embedding whose output is sharded on a non-feature dim (a learned
    position embedding, ``wpe(arange(s))`` -> [s, h], beside sequence-sharded tokens).
    Replicate -> Shard(d) is a local slice: no forward collective. Its backward is Shard(d)
    -> Replicate, an all-gather of the output's gradient, after which the embedding's
    weight gradient is whole on every rank."""
    if op.output is None or not graph.values[op.output].shape:
        return []
    y = graph.values[op.output]
    base = _replicate(op, graph, module)
    # [s, h] (positions without a batch) slices dim 0; [b, s, h] the sequence dims, never the batch
    dims = seq_dims(y.shape, tp) if len(y.shape) > 2 else [0] if y.shape[0] % tp == 0 and y.shape[0] >= tp else []
    return [
        replace(base, output=f"S{d}", bwd=(("all_gather", y.nbytes),), act_bytes=y.nbytes / tp,
                layouts={"weight": "R", "output": f"S{d}"})
        for d in dims
    ]


def _experts(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool = False) -> list[Strategy]:
    """An expert bank whole, or split over tp in one of two ways with the same collectives
    (the partial sums of every row all-reduced forward; backward, the gradients of the
    inputs the experts consumed whole, hidden states and routing weights):

    * ``moe_tp_experts``: tensor parallel inside every expert, the up (and gate) projections
      split on their output features, the down projection on its input features, as
      Megatron's MLP. Every rank runs every expert on all its rows, 1/tp of their width.
    * ``moe_whole_experts``: rank r holds experts [r E/tp, (r + 1) E/tp) whole and runs them
      on the rows routed to them (Hugging Face's all-reduce expert parallelism, an ep group
      equal to the tp group): 1/tp of the rows at full width, so 1/tp of the routed rows'
      traffic (gathered, run, added back), but the step waits for the busiest rank.

    Routing is priced as uniform; the busiest of tp ranks then holds about
    ``1 + sqrt(2 ln tp) sqrt((tp - 1) / rows)`` times its share of the ``rows = T k`` routed
    rows (the expected largest of tp binomial counts, in the normal approximation): a few
    percent at training batch sizes, much more at a decode step's few tokens."""
    from ..analyze.graph import expert_params

    ep = expert_params(module)
    inner = getattr(module, ep.down).shape[ep.down_dim]
    y = graph.values[op.output]
    bank = bank_call(graph, op)
    if bank is not None:  # routed T k rows, sorted rows, or every token once per expert
        rows = bank.tokens * bank.top_k
    else:  # any other call, e.g. every token through every expert weighted by scores [T, E]
        tokens = y.shape[0] if len(y.shape) == 2 else y.nbytes // y.shape[-1] // y.dtype.itemsize
        rows = tokens * (graph.values[op.inputs[1]].shape[-1] if len(op.inputs) > 1 and graph.values[op.inputs[1]].shape else 1)
    hidden = getattr(module, ep.up).shape[3 - ep.up_dim]
    flops = 3 * 2 * rows * hidden * inner * (3 if ep.packed or ep.gate else 2)
    # forward: each routed row read from the tokens, written as the experts' input, their
    # output written and added back into the tokens'
    width = bank.hidden if bank is not None else y.shape[-1]
    traffic = 4 * rows * width * y.dtype.itemsize
    out = [replace(_replicate(op, graph, module, flops), mem_bytes=traffic)]
    grads = tuple(("all_reduce", graph.values[v].nbytes) for v in op.inputs
                  if v in graph.requires_grad and graph.values[v].dtype.is_floating_point)
    outputs = ("R", "P") if sp else ("R",)  # P: the partial sums handed on, for the MoE block's return to reduce-scatter
    # the layout read off the shapes alone must give the hidden width the bank returns: an
    # unpacked bank [E, A, B] + [E, B, A] reads both ways, and a misread splits H, not I
    if inner % tp == 0 and not (ep.interleaved and inner * 2 // tp % 2) and hidden == width:
        inside = [Strategy("moe_tp_experts", tuple("R" for _ in op.inputs), o, fwd=(("all_reduce", y.nbytes),) * (o == "R"),
                           bwd=grads, param_bytes=_experts_param_bytes(module, ep.down_bias, tp), flops=flops / tp,
                           mem_bytes=traffic, act_bytes=y.nbytes,
                           layouts={**_experts_layouts("experts", o), **_router_grads(module)}) for o in outputs]
        out += inside + (_experts_on_sequence(op, graph, inside[0], tp) if sp else [])
    if bank is not None and bank.experts % tp == 0 and tp > 1:  # the calls WholeExperts takes
        busiest = busiest_share(rows, tp)
        out += [Strategy("moe_whole_experts", tuple("R" for _ in op.inputs), o, fwd=(("all_reduce", y.nbytes),) * (o == "R"),
                         bwd=grads, param_bytes=_param_bytes(module) / tp, flops=busiest * flops / tp,
                         mem_bytes=busiest * traffic / tp, act_bytes=y.nbytes, layouts=_experts_layouts("whole", o))
                for o in outputs]
    return out


def busiest_share(rows: int, ranks: int) -> float:
    """The busiest of ``ranks`` ranks' rows over its mean share when ``rows`` rows each pick a
    rank uniformly: the expected largest of ``ranks`` binomial counts, normally approximated."""
    if ranks <= 1 or rows <= 0:
        return 1.0
    return min(float(ranks), 1.0 + math.sqrt(2 * math.log(ranks)) * math.sqrt((ranks - 1) / rows))


def _experts_on_sequence(op: Op, graph: OpGraph, s: Strategy, tp: int) -> list[Strategy]:
    """A bank that takes the tokens as ``[b, s, h]`` itself (its router inside) under sequence
    parallel, as Megatron's MLP: the sequence shards gathered on entry, the partial sums
    reduce-scattered back onto them where it returns; backward, the input's gradient
    reduce-scattered (summing each rank's share), the output's all-gathered."""
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    if len(op.inputs) != 1 or len(x.shape) != 3 or x.shape[1] % tp or y.shape != x.shape:
        return []
    grad = (("reduce_scatter", x.nbytes),) if op.inputs[0] in graph.requires_grad else ()
    return [replace(s, inputs=("S1",), output="S1", fwd=(("all_gather", x.nbytes), ("reduce_scatter", y.nbytes)),
                    bwd=(("all_gather", y.nbytes),) + grad, act_bytes=y.nbytes / tp,
                    layouts={**{k: v for k, v in s.layouts.items() if k != "output"}, "input": "S1", "output": "S1"})]


def _router_grads(module: nn.Module) -> dict[str, tuple]:
    """A bank with its router inside (:func:`~shardplan.analyze.trace.bank_with_router`): the
    router runs whole on every rank, but the routing weights' gradient comes back from each
    rank's share of the experts' features, so the router's weight gradient is each rank's
    share too, summed with the other Partial gradients when backward ends."""
    from ..analyze.trace import bank_with_router

    names = bank_with_router(module) or []
    sizes = tuple(module.get_parameter(n).numel() * module.get_parameter(n).element_size() for n in names)
    return {"partial_grads": tuple(names), "partial_bytes": sizes} if names else {}


def _experts_layouts(weight: str, output: str) -> dict[str, str]:
    return {"weight": weight, "output": "P"} if output == "P" else {"weight": weight}


def _attention(op: Op, graph: OpGraph, module: nn.MultiheadAttention, tp: int, sp: bool) -> list[Strategy]:
    """torch's ``nn.MultiheadAttention``, whole or ``attention_heads``: split by heads, its
    packed in projection colwise (each rank's [q_r; k_r; v_r]) and ``out_proj`` rowwise, so
    one module is a Megatron attention block. The output is a partial sum: to Replicate an
    all-reduce, to Shard(seq) a reduce-scatter. q, k and v are read whole, so the gradient
    of each distinct input is summed across ranks (all-reduce), or, for inputs that arrive
    sequence-sharded and are gathered on entry, reduce-scattered. Averaged attention
    weights (``need_weights=True``, the default) are summed by one more all-reduce."""
    from .attention import attention_call

    call = attention_call(op, graph)
    y = graph.values[op.output]
    y_bytes = math.prod(y.shape) * y.dtype.itemsize  # the output alone, not the (output, weights) pair
    flops = call.flops(module)
    out = [_replicate(op, graph, module, flops)]
    if module.num_heads % tp or not call.splittable:
        return out
    out_dims = ["R"] + ([f"S{d}" for d in seq_dims(y.shape, tp)] if sp else [])
    in_dims = ["R"] + ([p for p in out_dims[1:] if call.shardable(graph, op, p, tp)])
    pbytes = _param_bytes(module)
    kept = module.out_proj.bias.numel() * module.out_proj.bias.element_size() if module.out_proj.bias is not None else 0
    for p_in in in_dims:
        for p_out in out_dims:
            fwd, bwd = call.comms(graph, op, p_in, p_out, y_bytes)
            out.append(Strategy(
                "attention_heads", call.placements(p_in), p_out, fwd=fwd, bwd=bwd,
                param_bytes=(pbytes - kept) / tp + kept, flops=flops / tp,
                act_bytes=y_bytes / (1 if p_out == "R" else tp),
                layouts={"weight": "S0p3", **({"input": p_in} if p_in != "R" else {}),
                         **({"output": p_out} if p_out != "R" else {})},
            ))
    return out


def _experts_param_bytes(module: nn.Module, down_bias: str | None, tp: int) -> float:
    """Everything is split tp ways except the down bias [E, H], which every rank holds."""
    whole = getattr(module, down_bias) if down_bias else None
    kept = whole.numel() * whole.element_size() if whole is not None else 0
    return (_param_bytes(module) - kept) / tp + kept


def _only_reader(graph: OpGraph, op: Op) -> bool:
    from .propagation import metadata_only

    readers = [c for c in graph.consumers.get(op.inputs[0], []) if not metadata_only(graph.ops[c])]
    return readers == [op.index]


def _norm(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool) -> list[Strategy]:
    x = graph.values[op.inputs[0]]
    pbytes = _param_bytes(module)
    out = [Strategy("replicate", ("R",), "R", param_bytes=pbytes, mem_bytes=2 * x.nbytes, act_bytes=x.nbytes, layouts={"weight": "R"})]
    last = len(x.shape) - 1
    if x.shape and x.shape[last] % tp == 0 and x.shape[last] >= tp:
        # a norm over all heads together (OLMo 2's q_norm/k_norm over [b, s, heads * hd]):
        # whole on the gathered projection, then each rank keeps its heads' features, as vLLM
        # does. Replicate -> Shard(-1) is a local slice; backward all-gathers the gradient
        out.append(Strategy(
            "replicate", ("R",), f"S{last}", bwd=(("all_gather", x.nbytes),), param_bytes=pbytes,
            mem_bytes=2 * x.nbytes, act_bytes=x.nbytes / tp, layouts={"weight": "R", "output": f"S{last}"},
        ))
        out += _sharded_norm(x, module, pbytes, last, tp) if _projected(graph, op) else []
        # the same on a value split by heads that only the norm reads, gathered where the norm
        # receives it (BitNet's attn_sub_norm over the attention's output, before o_proj): one
        # all-gather forward, the gradient the output's all-gather makes whole sliced back;
        # attention stays split. Not the residual stream, which a gather would not shorten
        if _only_reader(graph, op):
            out.append(Strategy(
                "replicate", (f"S{last}",), f"S{last}", bwd=(("all_gather", x.nbytes),), entry=(f"S{last}>R",),
                param_bytes=pbytes, mem_bytes=2 * x.nbytes, act_bytes=x.nbytes / tp,
                layouts={"weight": "R", "output": f"S{last}"},
            ))
    for d in seq_dims(x.shape, tp) if sp or len(x.shape) >= 4 else []:
        # dim 1 of (batch, seq, hidden) is the sequence; a deeper dim is heads (q_norm/k_norm),
        # split with them whether or not sequence parallel was asked for
        name = "sequence_parallel" if d == 1 and len(x.shape) == 3 else "replicated_with_grad_allreduce"
        out.append(_on_shards(op, graph, module, d, tp, name=name))
        if name == "sequence_parallel" and _read_whole(graph, op):
            out.append(_gathered_on_return(out[-1], graph.values[op.output].nbytes, d))
    for k in sorted(folded_values(graph, tp).get(op.inputs[0], ())) if sp and len(x.shape) == 2 else []:
        # tokens flattened with the sequence split (OPT's [b * s, h], :mod:`.folded`): per token
        if x.shape[0] % (k * tp) == 0:
            s = _on_shards(op, graph, module, 0, tp, name="sequence_parallel")
            out.append(replace(s, inputs=(packed(0, k),), output=packed(0, k), layouts={**s.layouts, "input": packed(0, k)}))
    if under_partial_grad_owner(op.target.rpartition(".")[0], graph, tp):
        # on an Rp value (MLA's kv_a_layernorm): whole, its weight gradient a partial sum
        out.append(Strategy(
            "replicated_with_grad_allreduce", ("Rp",), "Rp", param_bytes=pbytes, mem_bytes=2 * x.nbytes,
            bwd=_param_grad_allreduces(module),
            act_bytes=x.nbytes, layouts={"weight": "R", "input": "R"},
        ))
    return out + (_grouped_norm(x, module, pbytes, tp) if op.inputs[0] in grouped_values(graph, tp) else [])


_ACROSS = frozenset({"getitem", "select", "narrow", "index_select", "mean", "sum", "amax", "max", "logsumexp"})
# a product in the model's own code (a tied head ``F.linear(x, self.embed.weight)``): no style of
# its own gathers the tokens on entry
_PRODUCTS = frozenset({"linear", "matmul", "__matmul__", "mm", "einsum"})


def _read_whole(graph: OpGraph, op: Op, depth: int = 3) -> bool:
    """The model returns the module's output, or code reads it across the sequence (an op of
    :data:`_ACROSS` that drops or cuts dim 1: ``x[:, 0]``, ``x.mean(dim=1)``) or multiplies it
    (:data:`_PRODUCTS`), as it is or through ops of one input that keep its shape (T5's encoder
    returns it through dropout). Modules reading it gather it on their own entry."""
    seq = graph.values[op.output].shape[1]
    for c in graph.consumers.get(op.output, []):
        user = graph.ops[c]
        shape = graph.values[user.output].shape if user.output in graph.values else None
        across = user.target in _ACROSS and shape is not None and (len(shape) < 2 or shape[1] != seq)
        if user.kind == "output" or (user.kind == "function" and (across or user.target in _PRODUCTS)):
            return True
        if (depth and user.kind == "function" and user.inputs == [op.output] and shape == graph.values[op.output].shape
                and _read_whole(graph, user, depth - 1)):
            return True
    return False


def _gathered_on_return(s: Strategy, nbytes: int, d: int) -> Strategy:
    """A norm on sequence shards whose output is all-gathered where the norm returns: the
    model returns it (an encoder's or a base decoder's final norm, with no head to gather it
    on entry), so the user gets whole hidden states as from one process, or code after it
    reads across the sequence (a ViT's ``head(x[:, 0])``, mean pooling, the last token's
    logits ``x[:, -1]``). Backward, the whole gradient every rank holds (each reader completes
    its own) is sliced back onto its shard: no collective. Where a Linear can gather on entry
    instead, that is cheaper (its backward reduce-scatters rather than all-reduces)."""
    return replace(s, output="R", fwd=(("all_gather", nbytes),), layouts={**s.layouts, "output": "R"})


def _producer(graph: OpGraph, op: Op) -> Op:
    return graph.ops[graph.values[op.inputs[0]].producer]


def _projected(graph: OpGraph, op: Op) -> bool:
    """The norm reads a projection's output (q_norm(q_proj(x))), not the residual stream."""
    producer = _producer(graph, op)
    return producer.kind == "module" and producer.module_kind in ("linear", "conv1d")


def _sharded_norm(x, module: nn.Module, pbytes: int, last: int, tp: int) -> list[Strategy]:
    """A norm over features split tp ways, on its split (OLMo 2's q_norm over all heads,
    ``Shard(2)`` from a colwise q_proj): its code runs on DTensors, where the statistic over the
    features (``x.pow(2).mean(-1)``) is a partial result all-reduced once, ``[b, s, 1]``, and
    its weight is split with the features; backward reduce-scatters once. Instead of gathering
    q and k for the norm, as vLLM and Hugging Face do, each layer moves ``b s`` values. A
    norm written out in the model's own code, or torch's ``nn.RMSNorm`` (whose fused kernel
    DTensor runs on whole features: the style writes it out), with parameters over the
    features alone; the local check counts the collectives its code makes and keeps it whole
    if it gathers."""
    params = list(module.parameters(recurse=False))
    torch_own = type(module).forward.__module__.startswith("torch.nn.") and type(module) is not nn.RMSNorm
    if torch_own or not params or any(
            tuple(p.shape) != (x.shape[last],) for p in params):
        return []
    stat = x.nbytes // x.shape[last] // x.dtype.itemsize * 4  # one fp32 value per row
    return [Strategy("norm_sharded", (f"S{last}",), f"S{last}", fwd=(("all_reduce", stat),), bwd=(("reduce_scatter", stat),),
                     param_bytes=pbytes / tp, mem_bytes=2 * x.nbytes / tp, act_bytes=x.nbytes / tp,
                     layouts={"weight": "S0", "input": f"S{last}", "output": f"S{last}"})]


def _param_grad_allreduces(module: nn.Module) -> tuple:
    """One all-reduce of each own parameter's Partial gradient (bucketed by gradsync)."""
    return tuple(("all_reduce", p.numel() * p.element_size()) for p in module.parameters(recurse=False))


def _grouped_norm(x, module: nn.Module, pbytes: int, tp: int) -> list[Strategy]:
    """A per-head norm (Qwen3's k_norm) on grouped kv heads: it runs on the rank's kv head, and
    its weight gradient, a partial sum (each rank back-propagates its own query heads' share),
    adds up over all tp ranks like a sequence-parallel norm's."""
    grads = _param_grad_allreduces(module)
    return [Strategy(
        "replicated_with_grad_allreduce", (grouped(d, n),), grouped(d, n), bwd=grads, param_bytes=pbytes,
        mem_bytes=2 * x.nbytes / n, act_bytes=x.nbytes / n, layouts={"weight": "R", "input": f"S{d}"},
    ) for n in group_counts(tp) for d in range(1, len(x.shape) - 1) if x.shape[d] == n]
