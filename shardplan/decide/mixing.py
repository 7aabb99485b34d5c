"""Routing that mixes a batch's tokens: what data parallelism, ep included, changes.

Contract
--------
``batch_mixing(graph)`` gives, for each mixture-of-experts layer (the module whose code runs
a router and then a bank or a list of experts, :mod:`.banks`), the first op of that layer's
code that runs along the tokens of the router's scores: a scan (Switch's and GShard's
capacity, ``cumsum(mask, dim=0)``: a token's place in its expert's queue), a top-k, sort or
softmax over tokens (expert choice: each expert picks its tokens). ``mixing_warnings(graph,
axes)`` words one warning per layer where the mesh has a data axis (``dp``, ``fsdp``, ``ep``
...) of more than one rank. Names, shapes and dims only: nothing is run.

Why: every rank of a data axis routes its own rows. Top-k over each token's own scores
(Mixtral, DeepSeek, Qwen) gives the same choice whatever rows share a rank; routing along
the tokens does not: a capacity fills up by the rank's own tokens, expert choice picks among
them. That is GShard's "local groups" and what Megatron and torchtitan do too, a sound way
to train, but not one process on the whole batch, so ``verify`` against one process differs
and nothing else would say why. The tokens' dims are followed from the router's output
(every dim but the last, the experts') through transposes, views and ops that keep the
leading dims; counts (``bincount``, ``histc``) and means over tokens (an auxiliary loss)
change no token's result and are not flagged.
"""

from __future__ import annotations

from ..analyze.graph import Op, OpGraph
from .banks import inside, listed_banks, routed_banks, routes
from .placements import VIEW_OPS, permutation, view_groups
from .slices import place

__all__ = ["batch_mixing", "mixing_warnings"]

# ops whose result for one token depends on the others' along ``dim``
_ALONG = {"cumsum": -1, "cumprod": -1, "cummax": -1, "cummin": -1, "topk": -1, "sort": -1, "argsort": -1,
          "softmax": None, "log_softmax": None, "kthvalue": -1}
_DIM_AT = {"topk": 2, "kthvalue": 2}  # positional index of ``dim`` (x, k, dim); the rest (x, dim)


def batch_mixing(graph: OpGraph) -> dict[str, Op]:
    """MoE layer -> the first op of its code that runs along its router's tokens."""
    out: dict[str, Op] = {}
    for layer, experts in _layers(graph):
        found = _first_mixer(graph, layer, experts)
        if found is not None:
            out[layer] = found
    return out


def mixing_warnings(graph: OpGraph, axes: dict[str, int], tp_axis: str) -> list[str]:
    data = {a: n for a, n in axes.items() if a != tp_axis and n > 1}
    if not data:
        return []
    from ..analyze.trace import _user_line

    where = ", ".join(f"{a}={n}" for a, n in data.items())
    return [f"{layer}: its routing runs along the tokens: `{op.target}` ({_user_line(op.node)}) over the tokens "
            f"of the router's scores (dim {_dim(graph, op)} of its input); each rank of {where} routes its own rows "
            "(GShard's local groups), so the result is not one process's on the whole batch (`verify` differs); a "
            "top-k over each token's own scores would not depend on the batch"
            for layer, op in batch_mixing(graph).items()]


def _layers(graph: OpGraph) -> list[tuple[str, int]]:
    """(MoE layer, E) for each bank (its parent) and each list of experts (the list's parent)."""
    banks = routed_banks(graph) + listed_banks(graph)
    return sorted({(b.module.rpartition(".")[0], b.experts) for b in banks})


def _first_mixer(graph: OpGraph, layer: str, experts: int) -> Op | None:
    tokens: dict[int, set[int]] = {}  # value -> its tokens' dims
    for op in graph.ops:
        if op.output is None or not inside(place(op), layer):
            continue
        if routes(op, graph, layer, experts):
            shape = graph.values[op.output].shape
            tokens[op.output] = set(range(len(shape) - 1))
            continue
        tracked = [v for v in op.inputs if v in tokens]
        if not tracked:
            continue
        src = tracked[0]
        if op.target in _ALONG and op.inputs and op.inputs[0] == src and _dim(graph, op) in tokens[src]:
            return op
        dims = _carried(graph, op, src, tokens[src])
        if dims:
            tokens[op.output] = dims
    return None


def _dim(graph: OpGraph, op: Op) -> int:
    """The dim ``op`` runs along, made non-negative."""
    args, kwargs = op.node.args, op.node.kwargs
    at = _DIM_AT.get(op.target, 1)
    dim = kwargs.get("dim", args[at] if len(args) > at else _ALONG.get(op.target))
    ndim = len(graph.values[op.inputs[0]].shape)
    return int(dim) % ndim if isinstance(dim, int) and ndim else -1


def _carried(graph: OpGraph, op: Op, src: int, dims: set[int]) -> set[int]:
    """The tokens' dims of ``op``'s output: through a permutation or a view, or kept where the
    output keeps the input's leading dims (elementwise ops, a top-k or softmax over the
    experts, ``one_hot``, a gather of the chosen scores)."""
    src_shape, out_shape = graph.values[src].shape, graph.values[op.output].shape
    order = permutation(op, len(src_shape))
    if order is not None:
        return {o for o, i in enumerate(order) if i in dims}
    if op.target in VIEW_OPS:
        found: set[int] = set()
        for si, di in view_groups(tuple(src_shape), tuple(out_shape)):
            if si and all(i in dims for i in si if src_shape[i] != 1):
                found.update(d for d in di if out_shape[d] != 1)
        return found
    return {d for d in dims if d < len(out_shape) and out_shape[d] == src_shape[d]}
