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
* sequence_parallel (norms): the activation is sharded on the sequence; the norm is
  per-token so it runs locally, but its weight gradient sums over tokens: Partial,
  all-reduced once per step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from .graph import Op, OpGraph
from .strategies import Strategy

__all__ = ["module_strategies", "STYLE_NAMES"]

STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "embedding_rowwise",
    "sequence_parallel",
    "replicate",
)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.dim() >= 2)


def _seq_dims(shape: tuple[int, ...], tp: int) -> list[int]:
    """Dims an activation may be sharded on besides features (sequence parallel)."""
    return [d for d in range(len(shape) - 1) if shape[d] % tp == 0 and shape[d] >= tp and d >= 1]


def module_strategies(op: Op, graph: OpGraph, *, tp: int, opts: Any = None) -> list[Strategy]:
    module = graph.model.get_submodule(op.target)
    sp_opt = getattr(opts, "sequence_parallel", None)
    sp = sp_opt is not False
    kind = op.module_kind
    if kind == "linear" and len(op.inputs) == 1:
        found = _linear(op, graph, module, tp, sp)
    elif kind == "embedding" and len(op.inputs) == 1:
        found = _embedding(op, graph, module, tp, sp)
    elif kind == "norm" and len(op.inputs) == 1:
        found = _norm(op, graph, module, tp, sp)
        if sp_opt is True and len(found) > 1:  # the user asked for sequence parallel norms
            found = found[1:]
    else:
        found = [_replicate(op, graph, module)]
    full = _weight_bytes(module)
    return [replace(s, weight_bytes=full if s.layouts.get("weight", "R") == "R" else full / tp) for s in found]


def _replicate(op: Op, graph: OpGraph, module: nn.Module, flops: float = 0.0) -> Strategy:
    out = graph.values[op.output].nbytes if op.output is not None else 0
    return Strategy(
        "replicate", tuple("R" for _ in op.inputs), "R" if op.output is not None else None,
        param_bytes=_param_bytes(module), flops=flops, act_bytes=out, layouts={"weight": "R"},
    )


def _linear(op: Op, graph: OpGraph, module: nn.Linear, tp: int, sp: bool) -> list[Strategy]:
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    tokens = x.nbytes // max(x.shape[-1], 1) // x.dtype.itemsize if x.shape else 0
    flops = 3 * 2 * tokens * module.in_features * module.out_features  # fwd + dx + dW
    pbytes = _param_bytes(module)
    last = len(y.shape) - 1
    out: list[Strategy] = [_replicate(op, graph, module, flops)]
    if module.out_features % tp == 0:
        col = dict(param_bytes=pbytes / tp, flops=flops / tp, act_bytes=y.nbytes / tp)
        out.append(Strategy("colwise", ("R",), f"S{last}", entry=("R",), layouts={"weight": "S0"}, **col))
        out.append(Strategy(
            "colwise_gather_output", ("R",), "R", fwd=(("all_gather", y.nbytes),), entry=("R",),
            layouts={"weight": "S0", "output": "R"}, **col,
        ))
        for d in _seq_dims(x.shape, tp) if sp else []:
            out.append(Strategy(
                "colwise", (f"S{d}",), f"S{last}", entry=(f"S{d}",),
                layouts={"weight": "S0", "input": f"S{d}"}, **col,
            ))
            out.append(Strategy(
                "colwise_gather_output", (f"S{d}",), "R", fwd=(("all_gather", y.nbytes),), entry=(f"S{d}",),
                layouts={"weight": "S0", "input": f"S{d}", "output": "R"}, **col,
            ))
    if module.in_features % tp == 0:
        bias = module.bias.numel() * module.bias.element_size() if module.bias is not None else 0
        row = dict(param_bytes=(pbytes - bias) / tp + bias, flops=flops / tp)
        in_shard = f"S{len(x.shape) - 1}"
        out.append(Strategy("rowwise", (in_shard,), "R", fwd=(("all_reduce", y.nbytes),), act_bytes=y.nbytes, layouts={"weight": "S1"}, **row))
        for d in _seq_dims(y.shape, tp) if sp else []:
            out.append(Strategy(
                "rowwise", (in_shard,), f"S{d}", fwd=(("reduce_scatter", y.nbytes),), bwd=(("all_gather", y.nbytes),),
                act_bytes=y.nbytes / tp, layouts={"weight": "S1", "output": f"S{d}"}, **row,
            ))
    return out


def _embedding(op: Op, graph: OpGraph, module: nn.Embedding, tp: int, sp: bool) -> list[Strategy]:
    y = graph.values[op.output]
    pbytes = _param_bytes(module)
    last = len(y.shape) - 1
    out: list[Strategy] = [_replicate(op, graph, module)]
    if module.num_embeddings % tp == 0:
        out.append(Strategy(
            "embedding_rowwise", ("R",), "R", fwd=(("all_reduce", y.nbytes),),
            param_bytes=pbytes / tp, act_bytes=y.nbytes, layouts={"weight": "S0"},
        ))
        for d in _seq_dims(y.shape, tp) if sp else []:
            out.append(Strategy(
                "embedding_rowwise", ("R",), f"S{d}", fwd=(("reduce_scatter", y.nbytes),), bwd=(("all_gather", y.nbytes),),
                param_bytes=pbytes / tp, act_bytes=y.nbytes / tp, layouts={"weight": "S0", "output": f"S{d}"},
            ))
    if module.embedding_dim % tp == 0:
        out.append(Strategy("colwise", ("R",), f"S{last}", param_bytes=pbytes / tp, act_bytes=y.nbytes / tp, layouts={"weight": "S1"}))
    return out


def _norm(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool) -> list[Strategy]:
    x = graph.values[op.inputs[0]]
    pbytes = _param_bytes(module)
    out: list[Strategy] = [_replicate(op, graph, module)]
    out[0] = Strategy("replicate", ("R",), "R", param_bytes=pbytes, mem_bytes=2 * x.nbytes, act_bytes=x.nbytes, layouts={"weight": "R"})
    for d in _seq_dims(x.shape, tp) if sp else []:
        out.append(Strategy(
            "sequence_parallel", (f"S{d}",), f"S{d}", bwd=tuple(("all_reduce", p.numel() * p.element_size()) for p in module.parameters(recurse=False)),
            param_bytes=pbytes, mem_bytes=2 * x.nbytes / tp, act_bytes=x.nbytes / tp, layouts={"weight": "R", "input": f"S{d}"},
        ))
    return out
