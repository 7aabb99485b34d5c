"""Listed heads: attention written as a list of head modules, split by whole heads over tp.

Contract
--------
``listed_strategies(op, graph, module, tp, sp)`` gives a module that
:func:`~shardplan.analyze.trace.listed_heads` recognized by structure (Karpathy's "Let's
build GPT": ``self.proj(torch.cat([h(x) for h in self.heads], dim=-1))``) its
``listed_heads`` strategies, or [] where its call does not fit or tp does not divide the
heads; ``listed_whole`` says why it stays whole. The call fits when, run once on meta
tensors: every head is called once, all on the same tensors, which are the module's own
inputs; their outputs ``[..., w]`` are concatenated on the last dim in list order; and that
concatenation (or an elementwise op of it, a dropout) is the projection's input. Nothing here
needs a process group, and the module is left as it was (:func:`~shardplan.analyze.snapshot.preserved`).

The matrix math is Megatron's attention block with the head split read off the list: for
n heads h_i of width w and a projection P ``[d, n w]``,

    Y = cat_i(h_i(X)) P^T = sum_r cat_{i in rank r}(h_i(X)) P_r^T

with P_r the ``n w / tp`` columns of P that read rank r's heads. So rank r holds heads
``[r n/tp, (r + 1) n/tp)`` whole and runs their code as written (no size in it changes), and
P is ``rowwise``: each rank's product is a partial sum, all-reduced (or reduce-scattered onto
sequence shards) where the projection returns. Backward, X's gradient on each rank is its
heads' share: summed once on entry (an all-reduce; for an input gathered from sequence
shards, the gather's reduce-scatter), as a colwise Linear's input is. P's bias is added once,
after the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..analyze.graph import Op, OpGraph
from ..analyze.snapshot import preserved
from ..analyze.trace import listed_heads, module_signature
from .functional import call_signature, meta_args, params_on_meta
from .placements import Strategy, seq_dims

__all__ = ["ListedCall", "listed_call", "listed_strategies", "listed_whole"]

_CATS = frozenset({"cat", "concat", "concatenate"})


@dataclass(frozen=True)
class ListedCall:
    """What one run of the module showed: its ``heads`` list and ``proj`` children, n heads
    of output width w, the FLOPs of the call (forward and backward), and whether the module
    returns the projection's output (through elementwise ops only: a dropout)."""

    heads: str
    proj: str
    n: int
    width: int
    flops: float
    direct: bool


class _Flow(TorchFunctionMode):
    """Each ``torch.cat`` (its parts, dim and result) and each elementwise step (a result
    shaped as its one tensor argument: dropout, an activation) the forward takes."""

    def __init__(self) -> None:
        super().__init__()
        self.cats: list[tuple[tuple[torch.Tensor, ...], int, torch.Tensor]] = []
        self.came_from: dict[int, torch.Tensor] = {}  # id(result) -> its one tensor argument
        self.keep: list[Any] = []  # every tensor seen stays alive, so no id is reused
        self.inside = 0  # > 0 while a head runs
        self.outside: set[int] = set()  # tensors read by the module's code outside its heads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        if not self.inside and name != "__get__":  # reading x.shape or x.dtype computes nothing
            self.outside.update(id(t) for t in tensors)
        if name in _CATS and args and isinstance(args[0], (list, tuple)):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            self.cats.append((tuple(args[0]), dim, out))
        elif isinstance(out, torch.Tensor) and len(tensors) == 1 and tensors[0].shape == out.shape \
                and tensors[0] is not out:  # an in-place op hands back its argument
            self.came_from[id(out)] = tensors[0]
        self.keep += [out, *tensors]
        return out

    def source(self, t: Any) -> Any:
        """``t`` followed back through elementwise steps."""
        while isinstance(t, torch.Tensor) and id(t) in self.came_from:
            t = self.came_from[id(t)]
        return t


def listed_call(module: nn.Module, args: tuple, kwargs: dict) -> ListedCall | str:
    """Run ``module`` once on the meta tensors ``args``/``kwargs`` and check its call fits
    (module docstring); the :class:`ListedCall`, or why it does not fit."""
    from torch.utils.flop_counter import FlopCounterMode

    names = listed_heads(module)
    if names is None:
        return "it is no list of heads and a projection"
    heads, proj = (module.get_submodule(n) for n in names)
    calls: list[tuple[tuple, Any]] = []
    seen: dict[str, Any] = {}
    with preserved(module), torch.no_grad():
        params_on_meta(module, lambda _, p: nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        flow = _Flow()

        def enter(_module: nn.Module, _args: tuple) -> None:
            flow.inside += 1

        def leave(_module: nn.Module, args: tuple, out: Any) -> None:
            flow.inside -= 1
            calls.append((args, out))

        hooks = [h.register_forward_pre_hook(enter) for h in heads] + [h.register_forward_hook(leave) for h in heads]
        hooks.append(proj.register_forward_hook(lambda _m, a, out: seen.update(proj_in=a[0] if a else None, proj_out=out)))
        try:
            with FlopCounterMode(display=False) as flops, flow:
                out = module(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - code that cannot run on meta stays whole
            return f"its code fails on meta tensors ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        finally:
            for h in hooks:
                h.remove()
    why = _misfit(calls, len(heads), args, kwargs, flow, seen)
    if why:
        return why
    width = calls[0][1].shape[-1]
    direct = flow.source(out) is seen["proj_out"]
    return ListedCall(names[0], names[1], len(heads), int(width), 3.0 * flops.get_total_flops(), direct)


def _misfit(calls: list, n: int, args: tuple, kwargs: dict, flow: _Flow, seen: dict) -> str | None:
    """Why the recorded call does not fit the listed-heads form, or None."""
    if len(calls) != n:
        return f"its {n} heads were called {len(calls)} times in one forward, not once each"
    own = {id(t) for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)}
    first = tuple(id(a) for a in calls[0][0])
    if any(tuple(id(a) for a in a_) != first for a_, _ in calls) or not set(first) <= own or not first:
        return "its heads are not all called on the module's own inputs"
    if set(first) & flow.outside:  # a residual inside: its gradient is whole, not one rank's heads' share
        return "its code reads its input outside its heads too"
    outs = [o for _, o in calls]
    if not all(isinstance(o, torch.Tensor) and o.shape == outs[0].shape for o in outs):
        return "its heads' outputs are not tensors of one shape"
    cat = next((c for c in flow.cats if [id(p) for p in c[0]] == [id(o) for o in outs]), None)
    if cat is None or cat[1] not in (-1, outs[0].dim() - 1):
        return "its heads' outputs are not concatenated, in list order, on their last dim"
    if flow.source(seen.get("proj_in")) is not cat[2]:
        return "the projection does not read the heads' concatenated outputs"
    return None


def _cached_call(op: Op, graph: OpGraph, module: nn.Module) -> ListedCall | str:
    key = ("listed", module_signature(module), call_signature(op))
    if key not in graph.strategy_cache:  # alike blocks are checked once
        args, kwargs = meta_args(op)
        graph.strategy_cache[key] = listed_call(module, args, kwargs)
    return graph.strategy_cache[key]


def listed_whole(op: Op, graph: OpGraph, module: nn.Module, tp: int) -> str:
    """Why the module's heads run whole on every rank (its ``replicate`` warning)."""
    call = _cached_call(op, graph, module) if graph.traced.front_end != "export" else \
        "the export front end reads no module list (plan with the fx front end)"
    if isinstance(call, str):
        return f"its heads run whole on every rank: {call}; replicated"
    if call.n % tp:
        return f"its {call.n} heads run whole on every rank: tp={tp} does not divide them; use a tp that divides {call.n}"
    return f"its {call.n} heads run whole on every rank: splitting them is slower here (`shardplan explain` prices each style)"


def listed_strategies(op: Op, graph: OpGraph, module: nn.Module, tp: int, sp: bool) -> tuple[list[Strategy], float]:
    """``listed_heads`` per input and output layout (whole ``R`` or sequence shards ``S{d}``
    gathered on entry; the partial output all-reduced to ``R`` or reduce-scattered to
    ``S{d}``, the latter only when the module returns the projection's output as it is), and
    the call's FLOPs (0 when unknown)."""
    if graph.traced.front_end == "export" or op.output is None or not op.inputs:
        return [], 0.0
    call = _cached_call(op, graph, module)
    if isinstance(call, str):
        return [], 0.0
    if call.n % tp:
        return [], call.flops
    x, y = graph.values[op.inputs[0]], graph.values[op.output]
    proj = module.get_submodule(call.proj)
    pbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    kept = proj.bias.numel() * proj.bias.element_size() if proj.bias is not None else 0
    ins = ["R"] + ([f"S{d}" for d in seq_dims(x.shape, tp)] if sp else [])
    outs = ["R"] + ([f"S{d}" for d in seq_dims(y.shape, tp)] if sp and call.direct else [])
    found = []
    for p_in in ins:
        for p_out in outs:
            found.append(Strategy(
                "listed_heads", (p_in,) + ("R",) * (len(op.inputs) - 1), p_out,
                fwd=(("all_reduce" if p_out == "R" else "reduce_scatter", y.nbytes),),
                bwd=(("all_gather", y.nbytes),) if p_out != "R" else (), entry=(p_in,),
                param_bytes=(pbytes - kept) / tp + kept, flops=call.flops / tp,
                act_bytes=y.nbytes / (1 if p_out == "R" else tp),
                layouts={"weight": "listed", **({"input": p_in} if p_in != "R" else {}),
                         **({"output": p_out} if p_out != "R" else {})}))
    return found, call.flops
