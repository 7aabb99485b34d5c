"""Functional weights: a module whose own code reads its weights as tensors, run on DTensors.

Contract
--------
``functional_strategies(op, graph, module, tp, sp)`` gives a weight module of no known kind
(it owns its parameters and no child does, or only norms do; it is no Linear, norm,
embedding or expert bank) whose forward reads its own 2-D+ parameters in matrix products
(``F.linear(x, self.wq)``, ``x @ self.w1``, a DenseGeneral's ``einsum("btd,dhk->bthk", x,
self.kernel)``) its ``dtensor_weights`` strategies, or none. Nothing here needs or reads a
process group (:func:`.dtensor_run.probe_mesh`); the module runs on the meta device under
:func:`~shardplan.analyze.snapshot.preserved`, so the user's module is left as it was.

The matrix math is Megatron's, read off the code, never off names:

* a product whose activation comes from the module's inputs through ops that are no such
  product is *first*: its weight is split on a dim the product keeps (``F.linear``'s output
  rows, ``x @ W``'s columns, a kernel's heads), so each rank computes its own columns (or
  heads) with no collective, and the rest of the code (views by heads, RoPE, attention)
  runs on them;
* a product reading what a first product made is *second*: its weight is split on a dim
  the product contracts, so each rank's result is a partial sum; a product after it is
  first again (an MLP after the attention in one forward);
* a bias added by ``F.linear`` goes with a first weight's rows, and is whole for a second;
* where a weight may be split more than one way (a bank ``[E, D, F]`` by experts or on F),
  each way is a candidate; where the even split fails and the first products differ in
  width (one kv head), the narrower ones are kept whole.

DTensor's sharding propagation then runs the module's code, forward and backward, with each
candidate's placements: the code sizes its views by the global shapes it was written for,
so no head count needs making local. A candidate it runs is offered unless its forward
gathers a split value (attention would then run whole); the collectives DTensor issued
inside (an all-reduce before a residual, a kv gradient summed) are its price. Its output is
``Partial`` (summed where the module returns: an all-reduce, or a reduce-scatter onto
sequence shards), ``Shard(d)`` (a DenseGeneral's heads, handed on split) or ``Replicate``.
An input whose gradient comes back Partial is a region's entry, summed once however many
modules read it; one the code already sums needs nothing more.
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
from ..analyze.trace import module_signature
from .dtensor_run import ReplicateBeside, Recorded, probe_mesh
from .placements import Strategy
from .propagation import quiet_probes

__all__ = ["functional_strategies", "functional_placements", "call_signature", "meta_args", "params_on_meta"]

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


def meta_args(op: Op) -> tuple[tuple, dict]:
    def meta(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            return torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else val
        return a

    return tree_map(meta, tuple(op.node.args)), tree_map(meta, dict(op.node.kwargs))


def params_on_meta(module: nn.Module, make: Any) -> dict[str, nn.Parameter]:
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
    args, kwargs = meta_args(op)
    with preserved(module), torch.no_grad():
        made = params_on_meta(module, lambda _, p: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
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


@dataclass(frozen=True)
class _Run:
    """What the module's code did on DTensors: its output's placement, the whole parameters
    whose gradient came back Partial, and the collectives inside, forward and backward."""

    out: str
    partial: list[str]
    fwd: tuple[tuple[str, float], ...]
    bwd: tuple[tuple[str, float], ...]
    summed: tuple[bool, ...]  # per tensor input: its gradient comes back Partial, to be summed on entry


def _dtensor_output(op: Op, module: nn.Module, placements: dict[str, str], tp: int,
                    split: int | None = None) -> _Run | None:
    """Run the module's code on DTensors placed so, forward and backward, on meta tensors and
    :func:`.dtensor_run.probe_mesh`; None when an op has no DTensor rule, the forward gathers
    a split value whole (attention would then run whole), or the module returns more than one
    tensor. The output is read whole: ``P``, ``S{d}`` or ``R``."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = probe_mesh(tp)
    args, kwargs = _dtensor_args(op, mesh, split)
    fwd, bwd = Recorded(tp), Recorded(tp)
    with preserved(module), torch.enable_grad():
        made = params_on_meta(module, lambda n, p: nn.Parameter(_placed(p, placements[n], mesh), requires_grad=p.requires_grad))
        try:
            with implicit_replication(), ReplicateBeside(mesh):
                with fwd:
                    out = module(*args, **kwargs)
                if isinstance(out, DTensor) and out.requires_grad:
                    # backward starts as on the ranks: from the output summed on exit
                    whole = out.redistribute(mesh, (Replicate(),)) if out.placements[0].is_partial() else out
                    with bwd:
                        whole.to_local().sum().backward()
        except Exception:  # noqa: BLE001 - an op DTensor has no rule for
            return None
        partial = [n for n, p in made.items() if placements[n] == "R" and isinstance(p.grad, DTensor)
                   and p.grad.placements[0].is_partial()]
        summed = tuple(isinstance(t.grad, DTensor) and t.grad.placements[0].is_partial()
                       for t in tree_flatten((args, kwargs))[0] if isinstance(t, DTensor))
        # an input entered whole whose gradient the code leaves split (Hy-V4's hc_head: split
        # over its hyper-connection streams): from_local's backward all-gathers it to Replicate
        regathered = tuple(("all_gather", t.numel() * t.element_size()) for t in tree_flatten((args, kwargs))[0]
                           if isinstance(t, DTensor) and t.placements[0].is_replicate() and isinstance(t.grad, DTensor)
                           and t.grad.placements[0].is_shard())
    if not isinstance(out, DTensor) or len(out.placements) != 1 or any(k != "all_reduce" for k, _ in fwd.comms):
        return None
    p = out.placements[0]
    if p.is_partial() and p.reduce_op != "sum":
        return None
    where = "P" if p.is_partial() else f"S{p.dim}" if p.is_shard() else "R"
    return _Run(where, partial, tuple(fwd.comms), tuple(bwd.comms) + regathered, summed)


def _placed(p: torch.Tensor, placement: str, mesh: Any) -> torch.Tensor:
    """A meta DTensor of ``p``'s global shape on ``mesh``: ``S{d}`` or ``R``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = list(p.shape)
    where = Shard(int(placement[1:])) if placement.startswith("S") else Replicate()
    if where.is_shard():
        shape[where.dim] //= mesh.size()
    return DTensor.from_local(torch.empty(shape, dtype=p.dtype, device="meta"), mesh, (where,), run_check=False,
                              shape=p.shape, stride=p.stride())


def _dtensor_args(op: Op, mesh: Any, split: int | None) -> tuple[tuple, dict]:
    """The call's tensors as DTensors on ``mesh``: Replicate, the first ``Shard(split)``."""
    def leaf(a: torch.Tensor, placement: str = "R") -> torch.Tensor:  # its gradient kept, to be read
        d = _placed(a, placement, mesh).detach()
        return d.requires_grad_() if a.is_floating_point() else d

    args, kwargs = meta_args(op)
    first = leaf(args[0], f"S{split}" if split is not None else "R")
    args, kwargs = tree_map_only(torch.Tensor, leaf, (args[1:], kwargs))
    return (first,) + tuple(args), kwargs


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
        key = ("functional", module_signature(module), call_signature(op), tp, split)
        if key not in graph.strategy_cache:  # alike blocks a ModuleList holds as leaves run once
            with quiet_probes():
                graph.strategy_cache[key] = _runs(op, module, tp, split)
        valid, flops = graph.strategy_cache[key] or ([], flops)
        for plan, ran in valid:
            found += _layouts(op, graph, module, tp, sp, (plan, flops), ran, split)
    return found, flops if found else 0.0


def _runs(op: Op, module: nn.Module, tp: int, split: int | None) -> tuple[list[tuple[dict[str, str], _Run]], float] | None:
    """The candidate placements DTensor runs the code with, each with its run, and the FLOPs."""
    placed = functional_placements(op, module, tp, split)
    if placed is None:
        return None
    plans, flops, narrow = placed
    valid = [(plan, ran) for plan in plans if (ran := _dtensor_output(op, module, plan, tp, split)) is not None]
    if not valid and narrow:  # k and v whole: one kv head
        plan = {**plans[0], **narrow}
        valid = [(plan, ran)] if (ran := _dtensor_output(op, module, plan, tp, split)) is not None else []
    return valid, flops


def call_signature(op: Op) -> str:
    """The call's arguments by shape, dtype and constant value: equal, the same run."""
    def one(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)

    return repr(tree_map(one, (tuple(op.node.args), dict(op.node.kwargs))))


def _layouts(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool, placed: tuple[dict[str, str], float],
             ran: _Run, split: int | None) -> list[Strategy]:
    """One strategy per input and output layout. A whole first input is a region's *entry*
    (``R``, or ``S1`` gathered), as for a colwise Linear: the solver pays its collective once
    per value however many modules read it (q, k and v as three DenseGenerals); a split one
    (``S{d}``) is contracted where it is. Other tensor inputs' gradients are all-reduced; the
    Partial gradients of whole parameters (``partial_bytes``) join the bucket reduced when
    backward ends."""
    (placements, flops), out, partial = placed, ran.out, ran.partial
    y, x = graph.values[op.output], graph.values[op.inputs[0]]
    seq = ["S1"] if sp and len(y.shape) >= 3 and y.shape[1] % tp == 0 and y.shape[1] >= tp else []
    share = {n: p.numel() * p.element_size() / (tp if placements[n] != "R" else 1)
             for n, p in module.named_parameters()}
    pbytes, held = sum(share.values()), sum(b for n, b in share.items() if module.get_parameter(n).dim() >= 2)
    # other tensor inputs' gradients, where the code leaves them Partial (``_Run.summed``)
    grads = tuple(("all_reduce", graph.values[v].nbytes) for v, summed in zip(op.inputs[1:], ran.summed[1:])
                  if summed and v in graph.requires_grad and v != op.inputs[0])
    # a first input whose gradient the code already sums inside needs no entry all-reduce; from
    # sequence shards it is gathered, its whole gradient sliced back (``S1>R``)
    entry = (lambda p: (p,)) if not ran.summed or ran.summed[0] else (lambda p: (f"{p}>R",) if p != "R" else ())
    gathered = seq if len(x.shape) >= 3 and x.shape[1] % tp == 0 and x.shape[1] >= tp else []
    ins = [f"S{split}"] if split is not None else ["R"] + gathered
    found = []
    for p_in in ins:
        for p_out in (["R"] + seq if out == "P" else [out]):
            fwd = (("all_reduce" if p_out == "R" else "reduce_scatter", y.nbytes),) if out == "P" else ()
            bwd = (("all_gather", y.nbytes),) if out == "P" and p_out != "R" else ()
            found.append(Strategy(
                "dtensor_weights", (p_in,) + ("R",) * (len(op.inputs) - 1), p_out, fwd=ran.fwd + fwd,
                bwd=ran.bwd + bwd + grads,
                entry=entry(p_in) if split is None else (), param_bytes=pbytes, flops=flops / tp,
                act_bytes=y.nbytes / (1 if p_out == "R" else tp),
                layouts={"params": placements, "held": held, "partial_grads": partial, "partial_bytes": tuple(share[n] for n in partial), **({"input": p_in} if p_in != "R" else {}),
                         **({"output": p_out} if p_out != "R" else {})}))
    return found
