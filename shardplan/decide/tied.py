"""Tied reads: a weight module's parameter that other code also reads as a tensor.

Contract
--------
torchtune's ``TiedLinear`` (``F.linear(h, self.tied_module.weight)`` in a plain object),
OLMo's and many research GPTs' ``logits = F.linear(x, self.wte.weight)`` or
``x @ self.wte.weight.T``: the embedding table is also the output head, read outside the
embedding module. Such a weight is split as the module's style splits it, and the code that
reads it runs on that split, Megatron's vocab-parallel head:

* the read (a ``const`` of the parameter's FQN) takes the module's weight layout, the solver
  tying the two choices (:func:`.solve._tied_rows`); ``tied_values`` are the read and what
  views and transposes of it make (``W.t()``);
* a product of a whole activation with a tied value split on a dim it keeps (``h W^T`` with
  W ``Shard(0)``: each rank's vocabulary rows, logits ``Shard(-1)``) is a region's entry:
  the activation's gradient comes back a partial sum (``dh = sum_r dY_r W_r``), all-reduced
  once in backward. Its logits are all-gathered where the product returns them (the code
  after it reads whole logits: a loss, a softcap), so the product's output is ``R`` with a
  forward all-gather.

The apply stage runs the read on DTensors (:func:`~shardplan.apply.tied_style.tied_reads`).
"""

from __future__ import annotations

from dataclasses import replace

from ..analyze.graph import Op, OpGraph
from .placements import Strategy, shard_dim

__all__ = ["weight_read_elsewhere", "tied_values", "tied_product_twins"]

_PRODUCTS = frozenset({"linear", "matmul", "__matmul__", "mm", "einsum"})
_KEEPS = frozenset({"t", "transpose", "permute", "T", "mT", "swapaxes", "swapdims", "to", "type_as", "float", "half",
                    "bfloat16", "contiguous", "view", "reshape", "detach", "getattr"})


def weight_read_elsewhere(graph: OpGraph, op: Op) -> str | None:
    """The weight module whose parameter the const ``op`` reads outside it, or None."""
    from .weights import read_elsewhere

    if op.kind != "const":
        return None
    owner = op.target.rpartition(".")[0]
    return owner if owner in read_elsewhere(graph) else None


def tied_values(graph: OpGraph) -> frozenset[int]:
    """Reads of tied parameters, and values made from them alone by views, transposes and casts."""
    cached = graph.strategy_cache.get("tied_values")
    if cached is None:
        found: set[int] = set()
        for op in graph.ops:
            if op.output is None:
                continue
            if weight_read_elsewhere(graph, op) is not None or (
                    op.kind == "function" and op.target in _KEEPS and op.inputs and all(v in found for v in op.inputs)):
                found.add(op.output)
        cached = graph.strategy_cache["tied_values"] = frozenset(found)
    return cached


def tied_product_twins(op: Op, graph: OpGraph, strategies: list[Strategy]) -> list[Strategy]:
    """For a product of whole activations with a split tied value: the same strategy with the
    activations as region entries (``R``) and its output all-gathered where the product returns
    it (the apply stage gathers it there; the logits are never handed on split)."""
    if op.kind != "function" or op.target not in _PRODUCTS or op.output is None:
        return []
    tied = tied_values(graph)
    if not any(v in tied for v in op.inputs):
        return []
    out, nbytes = [], graph.values[op.output].nbytes
    for s in strategies:
        if shard_dim(s.output or "") is None or not any(p != "R" for p, v in zip(s.inputs, op.inputs) if v in tied):
            continue
        if any(p != "R" for p, v in zip(s.inputs, op.inputs) if v not in tied):
            continue
        entry = tuple("R" if v not in tied and v in graph.requires_grad else None for v in op.inputs)
        out.append(replace(s, output="R", entry=entry, fwd=(("all_gather", nbytes),)))
    return out
