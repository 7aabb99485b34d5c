"""Functional weights: a module whose own code reads its weights as tensors, run on DTensors.

Contract
--------
``functional_strategies(op, graph, module, tp, sp)`` gives a weight module of no known kind
(it owns its parameters, no child does, and it is no Linear, norm, embedding or expert bank)
whose forward reads its own 2-D+ parameters in matrix products (``F.linear(x, self.wq)``,
``x @ self.w1``, a DenseGeneral's ``einsum("btd,dhk->bthk", x, self.kernel)``) its
``dtensor_weights`` strategies, or none. Nothing here needs a process group; the module is
run on the meta device under :func:`~shardplan.analyze.snapshot.preserved`, so the user's
module is left as it was.

The matrix math is Megatron's, read off the code, never off names:

* a product whose activation comes from the module's inputs through ops that are no such
  product is *first*: its weight is split on a dim the product keeps (``F.linear``'s output
  rows, ``x @ W``'s columns, a kernel's heads), so each rank computes its own columns (or
  heads) with no collective, and the rest of the code (views by heads, RoPE, attention)
  runs on them;
* a product reading what a first product made is *second*: its weight is split on a dim
  the product contracts, so each rank's result is a partial sum;
* a bias added by ``F.linear`` goes with a first weight's rows, and is whole for a second.

DTensor's sharding propagation then runs the module's code with those placements, on meta
tensors and a mesh with no process group behind it: the code sizes its views by the global
shapes it was written for, so no head count needs making local. A module it runs with no
redistribution inside is offered. Its output is ``Partial`` (summed where the module
returns: an all-reduce, or a reduce-scatter onto sequence shards), ``Shard(d)`` (a
DenseGeneral's heads, handed on split) or ``Replicate``. The inputs are read whole, so each
one's gradient is a partial sum, all-reduced (or, gathered from sequence shards on entry,
reduce-scattered) in backward. A module whose code would need a collective inside (an MLP
after the attention in one forward) is not offered: it stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from ..analyze.graph import Op, OpGraph
from ..analyze.snapshot import preserved
from .placements import Strategy

__all__ = ["functional_strategies", "functional_placements", "ReplicateBeside"]

_PRODUCTS = frozenset({"linear", "matmul", "mm", "bmm", "__matmul__", "__rmatmul__", "einsum"})
_PERMUTES = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "movedim"})


@dataclass
class _Reads(TorchFunctionMode):
    """Follows the module's forward on meta tensors: which product reads which parameter (by
    ``self.w``, ``self.w.t()`` or ``self.w.T``), on which side, and whether the activation it
    multiplies comes from a first product (its *level* is 1) or not (0)."""

    names: dict[int, str]  # id(parameter) -> name
    tp: int
    level: dict[int, int] = field(default_factory=dict)  # id(activation) -> 1 after a first product
    perm: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # a parameter's transposed view
    options: dict[str, list[int]] = field(default_factory=dict)  # the dims each weight may be split on
    first: dict[str, tuple[int, str | None]] = field(default_factory=dict)  # width split, bias
    failed: list[str] = field(default_factory=list)
    alive: list[Any] = field(default_factory=list)  # ids stay unique while the run lasts

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: ``w.T``, ``w.mT``
            name = {torch.Tensor.T.__get__: "t", torch.Tensor.mT.__get__: "t"}.get(func, name)
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        operands = args[1:] if name == "einsum" else args[:2]  # F.linear's bias is no operand
        weights = [a for a in (operands if name in _PRODUCTS else flat)
                   if isinstance(a, torch.Tensor) and self._param(a) is not None]
        if name in _PERMUTES and weights and isinstance(out, torch.Tensor):
            self._transposed(name, args, out)
        elif name in _PRODUCTS and weights:
            self._product(name, args, kwargs, out, weights)
        else:
            level = max((self.level.get(id(a), 0) for a in flat), default=0)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.level[id(t)] = level
                    self.alive.append(t)
        return out

    def _param(self, t: torch.Tensor) -> tuple[str, tuple[int, ...]] | None:
        if id(t) in self.names:
            return self.names[id(t)], tuple(range(t.dim()))
        return self.perm.get(id(t))

    def _transposed(self, name: str, args: tuple, out: torch.Tensor) -> None:
        source, dims = self._param(args[0])
        order = list(range(out.dim()))
        if name == "t" and out.dim() == 2 or name in ("transpose", "swapaxes", "swapdims"):
            a, b = (0, 1) if name == "t" else (args[1] % out.dim(), args[2] % out.dim())
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            order = [d % out.dim() for d in (args[1] if isinstance(args[1], (list, tuple)) else args[1:])]
        else:
            self.failed.append(f"{source} read through {name}")
            return
        self.perm[id(out)] = (source, tuple(dims[o] for o in order))
        self.alive.append(out)

    def _product(self, name: str, args: tuple, kwargs: dict, out: Any, weights: list) -> None:
        operands = list(args[1:]) if name == "einsum" else list(args[:2])
        acts = [a for a in operands if isinstance(a, torch.Tensor) and self._param(a) is None]
        if len(weights) != 1 or len(acts) != 1:
            self.failed.append(f"{name} of {len(weights)} weights and {len(acts)} activations")
            return
        weight, act = weights[0], acts[0]
        second = self.level.get(id(act), 0) >= 1
        source, dims = self._param(weight)
        found = [dims[d] for d in _split_dims(name, args, weight, second=second)
                 if weight.shape[d] % self.tp == 0 and weight.shape[d] >= self.tp]
        if not found or self.options.setdefault(source, found) != found:
            self.failed.append(f"{source}: no dim of {list(weight.shape)} that tp={self.tp} divides, or read two ways")
            return
        bias = args[2] if name == "linear" and len(args) > 2 else kwargs.get("bias")
        bias = self._param(bias)[0] if isinstance(bias, torch.Tensor) and self._param(bias) is not None else None
        if bias is not None:
            self.options[bias] = [] if second else [0]  # with a first product's rows; whole after a second
        if not second:
            self.first[source] = (weight.shape[dims.index(found[0])], bias)
        if isinstance(out, torch.Tensor):
            self.level[id(out)] = 0 if second else 1
            self.alive.append(out)

    def candidates(self) -> list[dict[str, str]]:
        """The i-th choice of every weight (its last where it has fewer), for each i: one plan
        per way the products can be split (a bank ``[E, D, F]`` by whole experts, or inside
        each expert on F); DTensor's run tells which hold."""
        most = max((len(o) for o in self.options.values()), default=0)
        out = []
        for i in range(most):
            plan = {n: f"S{o[min(i, len(o) - 1)]}" if o else "R" for n, o in self.options.items()}
            if plan not in out:
                out.append(plan)
        return out


def _split_dims(name: str, args: tuple, weight: torch.Tensor, *, second: bool) -> list[int]:
    """The dims of ``weight`` (as the product reads it) a split may take, best first: those
    it keeps when first, those it contracts when second; then dims it shares with the
    activation as a batch (a bank's experts)."""
    if name == "einsum":
        return _einsum_dims(args, weight, second=second)
    if weight.dim() < 2:
        return []
    if name == "linear":  # y = x W^T: W [out, in]
        return [1 if second else 0]
    batch = list(range(weight.dim() - 2))
    if name == "__rmatmul__" or (len(args) > 1 and args[1] is weight):  # x @ W: W [.., in, out]
        return [weight.dim() - (2 if second else 1)] + batch
    return [weight.dim() - (1 if second else 2)] + batch  # W @ x


def _einsum_dims(args: tuple, weight: torch.Tensor, *, second: bool) -> list[int]:
    spec, operands = args[0], list(args[1:])
    if not isinstance(spec, str) or "->" not in spec or "." in spec:
        return []
    ins, out = spec.replace(" ", "").split("->")
    letters = ins.split(",")
    mine = letters[next(i for i, t in enumerate(operands) if t is weight)]
    others = "".join(t for i, t in enumerate(letters) if operands[i] is not weight)
    contracted = [d for d, c in enumerate(mine) if c not in out and c in others]
    kept = [d for d, c in enumerate(mine) if c in out and c not in others]
    batch = [d for d, c in enumerate(mine) if c in out and c in others]  # a bank's experts
    return (contracted if second else kept) + batch


class ReplicateBeside(TorchFunctionMode):
    """How ``dtensor_weights`` code runs, here on meta and on the ranks alike: a plain tensor
    read beside a DTensor (a mask made in forward, a RoPE buffer) is a Replicate DTensor for
    that call, so that backward, which reads what forward saved, meets DTensors only; and
    attention on q, k and v split alike on a leading dim (heads, batch) runs on each rank's
    shards, heads never mixing (DTensor has no rule for the CPU's attention kernel)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, Replicate

        kwargs = kwargs or {}
        if not any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        whole = lambda t: t if isinstance(t, DTensor) else DTensor.from_local(t, self.mesh, (Replicate(),), run_check=False)  # noqa: E731
        args, kwargs = tree_map_only(torch.Tensor, whole, (args, kwargs))
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _attention(args, kwargs)
        return func(*args, **kwargs)


def _attention(args: tuple, kwargs: dict) -> Any:
    """Attention on DTensors: on each rank's heads (:func:`_on_shards`), or on whole q, k and v
    as each rank holds them. Nothing else: DTensor's own rule for it (none on the CPU, another
    on meta) would make the plan depend on the device."""
    from torch.distributed.tensor import DTensor

    local = _on_shards(args, kwargs)
    if local is not None:
        return local
    flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)]
    if any(not p.is_replicate() for a in flat for p in a.placements):
        raise NotImplementedError("scaled_dot_product_attention on DTensors split otherwise than by heads alike")
    args, kwargs = tree_map_only(DTensor, lambda t: t.to_local(), (args, kwargs))
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return DTensor.from_local(out, flat[0].device_mesh, flat[0].placements, run_check=False)


def _on_shards(args: tuple, kwargs: dict) -> Any:
    """``scaled_dot_product_attention`` with the query split on a leading dim (heads, batch),
    run on each rank's shards, or None. A key or value split alike is read as its shard; a
    whole one (k and v kept whole beside fewer kv heads than tp, or one) is cut to the heads
    the rank's query heads read, and its gradient, each rank's share, is left Partial. A mask
    must be whole and 1 along that dim (it broadcasts)."""
    from torch.distributed.tensor import DTensor

    qkv, rest = list(args[:3]), dict(kwargs)
    qkv += [rest.pop(n) for n in ("query", "key", "value")[len(qkv):] if n in rest]
    mask = args[3] if len(args) > 3 else rest.get("attn_mask")
    d = qkv[0].placements[0].dim if len(qkv) == 3 and qkv[0].placements[0].is_shard() else None
    if d is None or d < 0 or d >= qkv[0].dim() - 2:
        return None
    if mask is not None and (not mask.placements[0].is_replicate() or (mask.dim() > qkv[0].dim() - 1 - d and
                                                                       mask.shape[d - qkv[0].dim()] != 1)):
        return None
    local = [qkv[0].to_local()] + [_rank_heads(t, d, qkv[0].shape[d]) for t in qkv[1:]]
    if any(t is None for t in local):
        return None
    if mask is not None:
        rest["attn_mask"] = mask.to_local()
    out = torch.nn.functional.scaled_dot_product_attention(*local, *(
        () if len(args) <= 3 else [rest.pop("attn_mask", None)] + list(args[4:])), **rest)
    return DTensor.from_local(out, qkv[0].device_mesh, qkv[0].placements, run_check=False)


def _rank_heads(t: Any, d: int, n: int) -> torch.Tensor | None:
    """The local key or value for the rank's ``n / tp`` query heads on dim ``d``: its shard
    when split alike; cut from a whole one (``m`` heads, each read by ``n / m`` query heads)."""
    from torch.distributed.tensor import Partial

    p = t.placements[0]
    if p.is_shard(d) and n % t.shape[d] == 0:  # split alike: the rank's kv heads are its query heads' own
        return t.to_local()
    if not p.is_replicate():
        return None
    mesh, m = t.device_mesh, t.shape[d]
    tp, rank = mesh.size(), mesh.get_coordinate()[0]
    mine, per = n // tp, n // m if m and n % m == 0 else 0
    if not per or n % tp:
        return None
    if mine % per == 0:  # whole kv heads per rank
        start, count = rank * mine // per, mine // per
    elif per % mine == 0:  # the rank's query heads all read one kv head
        start, count = rank * mine // per, 1
    else:
        return None
    return t.to_local(grad_placements=(Partial(),)).narrow(d, start, count)


def _meta_args(op: Op) -> tuple[tuple, dict]:
    def meta(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            return torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else val
        return a

    return tree_map(meta, tuple(op.node.args)), tree_map(meta, dict(op.node.kwargs))


def _on_meta(module: nn.Module, make: Any) -> dict[str, nn.Parameter]:
    """Every parameter of ``module`` (its norm children's too) replaced by ``make(name, p)``,
    every buffer by a meta copy; the caller holds :func:`preserved`, which puts them back."""
    made = {}
    for name, p in list(module.named_parameters()):
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        made[name] = owner._parameters[leaf] = make(name, p)
    for name, b in list(module.named_buffers()):
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        owner._buffers[leaf] = b.to("meta")
    return made


def functional_placements(op: Op, module: nn.Module, tp: int,
                          split: int | None = None) -> tuple[list[dict[str, str]], float, dict[str, str]] | None:
    """The candidate placements of the parameters (``S{d}`` or ``R`` each) when the module's
    code reads a 2-D+ one in a product and every such read fits the first/second rule
    (:meth:`_Reads.candidates`), the module's whole FLOPs
    (forward and backward), and the fallback for narrower first products (k and v beside a
    wider q: ``R``); else None. ``split``: the first input arrives split on that dim
    (a previous module's heads), so what reads it is second."""
    from torch.utils.flop_counter import FlopCounterMode

    if tp < 2 or not any(p.dim() >= 2 for p in module.parameters()):
        return None
    args, kwargs = _meta_args(op)
    with preserved(module), torch.no_grad():
        made = _on_meta(module, lambda _, p: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        reads = _Reads({id(p): n for n, p in made.items()}, tp)
        if split is not None:
            reads.level[id(args[0])] = 1
        try:
            with FlopCounterMode(display=False) as flops, reads:
                module(*args, **kwargs)
        except Exception:  # noqa: BLE001 - code that cannot run on meta is planned whole, as before
            return None
    if reads.failed or not reads.candidates():
        return None
    plans = [{n: plan.get(n, "R") for n in made} for plan in reads.candidates()]
    widest = max((w for w, _ in reads.first.values()), default=0)
    # fewer kv heads than tp, or one (MQA): the narrower first products (k, v) kept whole, as
    # Megatron and vLLM keep them, where their heads cannot be split
    narrow = {m: "R" for n, (w, b) in reads.first.items() if w < widest for m in (n, b) if m is not None}
    return plans, 3.0 * flops.get_total_flops(), narrow


def _dtensor_output(op: Op, module: nn.Module, placements: dict[str, str], tp: int,
                    split: int | None = None) -> tuple[str, list[str]] | None:
    """The placement of the module's output when its code runs on DTensors placed so, read
    whole (``P``, ``S{d}`` or ``R``), and the whole parameters whose gradient backward leaves
    Partial (a per-head norm's weight, read beside split heads); None when forward or backward
    needs a redistribution (with no process group behind the mesh, any collective fails) or
    the module returns more than one tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    from .propagation import _mesh, _tensor

    mesh = _mesh(tp)
    args, kwargs = _dtensor_args(op, mesh, split)
    with preserved(module), torch.enable_grad():
        made = _on_meta(module, lambda n, p: nn.Parameter(_tensor(p, placements[n], tp, distributed=True),
                                                          requires_grad=p.requires_grad))
        try:
            with implicit_replication(), ReplicateBeside(mesh):
                out = module(*args, **kwargs)
                if isinstance(out, DTensor) and out.requires_grad:
                    out.to_local().sum().backward()
        except Exception:  # noqa: BLE001 - a redistribution, or an op DTensor has no rule for
            return None
        partial = [n for n, p in made.items() if placements[n] == "R" and isinstance(p.grad, DTensor)
                   and p.grad.placements[0].is_partial()]
    if not isinstance(out, DTensor) or len(out.placements) != 1:
        return None
    p = out.placements[0]
    if p.is_partial():
        return ("P", partial) if p.reduce_op == "sum" else None
    return (f"S{p.dim}" if p.is_shard() else "R"), partial


def _dtensor_args(op: Op, mesh: Any, split: int | None) -> tuple[tuple, dict]:
    """The call's tensors as DTensors on ``mesh``: Replicate, the first ``Shard(split)``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    args, kwargs = _meta_args(op)
    whole = lambda a: DTensor.from_local(a, mesh, (Replicate(),), run_check=False)  # noqa: E731
    args, kwargs = tree_map_only(torch.Tensor, whole, (args, kwargs))
    if split is not None:
        x = args[0]
        shape = list(x.shape)
        shape[split] //= mesh.size()
        args = (DTensor.from_local(torch.empty(shape, dtype=x.dtype, device="meta"), mesh, (Shard(split),),
                                   run_check=False, shape=x.shape, stride=x.stride()),) + tuple(args[1:])
    return args, kwargs


def functional_strategies(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool) -> tuple[list[Strategy], float]:
    """``dtensor_weights`` for each input and output layout, or [] when the module's code does
    not fit (module docstring); and the module's FLOPs run whole (0 when not found). The first
    input is read whole (or gathered from sequence shards, ``Shard(1)``), or arrives split on a
    later dim (``Shard(d)``, d >= 2: the heads a previous module made) and is contracted there."""
    from ..analyze.graph import router_like

    if graph.traced.front_end == "export" or op.output is None or not op.inputs or not graph.values[op.output].shape \
            or router_like(module):  # routers are kept whole, as every MoE trainer keeps them
        return [], 0.0
    found, flops = [], 0.0
    x = graph.values[op.inputs[0]].shape
    for split in [None] + [d for d in range(2, len(x)) if x[d] % tp == 0 and x[d] >= tp]:
        placed = functional_placements(op, module, tp, split)
        if placed is None:
            continue
        plans, flops, narrow = placed
        valid = [(plan, ran) for plan in plans if (ran := _dtensor_output(op, module, plan, tp, split)) is not None]
        if not valid and narrow:  # k and v whole: one kv head
            plan = {**plans[0], **narrow}
            valid = [(plan, ran)] if (ran := _dtensor_output(op, module, plan, tp, split)) is not None else []
        for plan, ran in valid:
            found += _layouts(op, graph, module, tp, sp, (plan, flops), ran, split)
    return found, flops if found else 0.0


def _layouts(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool, placed: tuple[dict[str, str], float],
             ran: tuple[str, list[str]], split: int | None) -> list[Strategy]:
    """One strategy per input and output layout. A whole first input is a region's *entry*
    (``R``, or ``S1`` gathered), as for a colwise Linear: the solver pays its collective once
    per value however many modules read it (q, k and v as three DenseGenerals); a split one
    (``S{d}``) is contracted where it is. Other tensor inputs' gradients are all-reduced; the
    Partial gradients of whole parameters (``partial_bytes``) join the bucket reduced when
    backward ends."""
    (placements, flops), (out, partial) = placed, ran
    y, x = graph.values[op.output], graph.values[op.inputs[0]]
    seq = ["S1"] if sp and len(y.shape) >= 3 and y.shape[1] % tp == 0 and y.shape[1] >= tp else []
    share = {n: p.numel() * p.element_size() / (tp if placements[n] != "R" else 1)
             for n, p in module.named_parameters()}
    pbytes, held = sum(share.values()), sum(b for n, b in share.items() if module.get_parameter(n).dim() >= 2)
    grads = tuple(("all_reduce", graph.values[v].nbytes) for v in dict.fromkeys(op.inputs[1:])
                  if v in graph.requires_grad and v != op.inputs[0])
    gathered = seq if len(x.shape) >= 3 and x.shape[1] % tp == 0 and x.shape[1] >= tp else []
    ins = [f"S{split}"] if split is not None else ["R"] + gathered
    found = []
    for p_in in ins:
        for p_out in (["R"] + seq if out == "P" else [out]):
            fwd = (("all_reduce" if p_out == "R" else "reduce_scatter", y.nbytes),) if out == "P" else ()
            bwd = (("all_gather", y.nbytes),) if out == "P" and p_out != "R" else ()
            found.append(Strategy(
                "dtensor_weights", (p_in,) + ("R",) * (len(op.inputs) - 1), p_out, fwd=fwd, bwd=bwd + grads,
                entry=(p_in,) if split is None else (), param_bytes=pbytes, flops=flops / tp,
                act_bytes=y.nbytes / (1 if p_out == "R" else tp),
                layouts={"params": placements, "held": held, "partial_grads": partial, "partial_bytes": tuple(share[n] for n in partial), **({"input": p_in} if p_in != "R" else {}),
                         **({"output": p_out} if p_out != "R" else {})}))
    return found
