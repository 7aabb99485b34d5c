"""Expert parallelism for experts written as a list of modules: record, exchange, replay.

Contract
--------
``shard_listed_experts(layer, child, ep_mesh)`` splits ``layer.<child>``, an ``nn.ModuleList``
of E alike experts that the layer's own code calls on the rows its router chose (mistral's
reference Mixtral, DeepSeek's inference code, research MoEs: ``for e, expert in
enumerate(self.experts): ... out.index_add_(0, tok, expert(x[tok]) * w)``), by whole experts
over the 1-D ``ep_mesh``: rank ``r`` keeps experts ``[r E/ep, (r + 1) E/ep)`` and the others
become :class:`RemoteExpert` placeholders with no parameters, so the state dict, DCP and FSDP
see only the rank's own (:func:`held_elsewhere` names the keys the other ranks hold). Every
other module treats ep as a data axis: each rank runs the layer on its own tokens.

The loop decides which experts run and on which rows, and it may skip idle ones, so no
collective can sit inside an expert's call (one rank would wait on a call another skipped).
The layer's forward runs twice instead:

1. *record*: each expert call hands back zeros shaped like its rows (an expert maps
   ``[n, H] -> [n, H]``) and keeps the rows, with their autograd history;
2. *exchange*: one dispatch per layer call, whatever the loop did: the rows go to their
   experts' ranks by all-to-all (counts first, then rows, as :mod:`.experts_ep` sends them),
   each rank runs each of its experts once on all the rows it received (an expert with none
   runs on zero rows, so FSDP and the backward's all-to-all see every rank), and the
   outputs go back the same way;
3. *replay*: the layer runs again and each expert call, in the same order, hands back its
   rows' outputs; the model's own code combines them (routing weights, index_add, shared
   experts, a residual): nothing of the routing is re-implemented here.

The replayed output depends on the recorded rows, so the input's gradient flows through the
record pass's indexing, and the router's through the replay's combine. Both passes draw the
same random numbers (``fork_rng``) and the layer's buffers are put back after the record
(a counter updated in forward counts once). A replayed call whose expert or rows differ from
the record's (code that feeds one expert's output to another) raises ``RuntimeError``: the
rows' values are compared on the layer's first call, their shapes on every call.

Gradients: an expert's parameters get the gradient of every rank's tokens routed to it, the
sum over ep; as for banks, they are scaled by ``1 / ep`` (the mean data parallelism takes),
and the rows' gradient is scaled back by ``ep`` so the input's is exact. Cost: the dense part
of the layer (router, shared experts) runs twice on the rank's own tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..analyze.graph import EXPERT_CONTAINERS, rows_width
from .dispatch import ScaleGrad, by_expert, exchange, send

__all__ = ["Owners", "held_whole", "RemoteExpert", "shard_listed_experts", "held_elsewhere", "held_here", "gather_listed_state"]


class RemoteExpert(nn.Module):
    """An expert another ep rank holds: no parameters here. ``held_state``: its state-dict
    keys, global shapes and dtypes, held by ep rank ``owner``; ``held_params``: the same of
    its parameters (the plan's fingerprint counts them)."""

    def __init__(self, owner: int, like: nn.Module) -> None:
        super().__init__()
        self.owner = owner
        self.held_state = [(k, tuple(t.shape), t.dtype) for k, t in like.state_dict().items()]
        self.held_params = [(n, tuple(p.shape), p.dtype) for n, p in like.named_parameters(remove_duplicate=False)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a RemoteExpert is held by another ep rank; the layer's dispatch calls it, not the model")

    def extra_repr(self) -> str:
        return f"owner=ep rank {self.owner}"


@dataclass(frozen=True)
class Owners:
    """A module list split whole over one mesh axis (experts over ep, heads over tp): the
    axis's process group, and how many consecutive modules each rank holds."""

    group: Any
    local: int


@dataclass
class _Dispatch:
    """One list's dispatch state: what the record pass saw, what the replay hands back."""

    experts: nn.Module  # the ModuleList, ModuleDict or Sequential
    group: Any
    ep: int
    local: int  # experts per rank
    first: int  # this rank's first expert
    hidden: int
    mode: str = "idle"  # "record" | "replay" | "idle"
    # the first call's replay compares each expert's rows with the record's values; later ones
    # their shapes only (a value compare syncs the host once per expert call on a GPU)
    verified: bool = False
    calls: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    at: int = 0

    def call(self, position: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"expert {position} was called with {len(args)} positional and {sorted(kwargs)} keyword "
                             "arguments; expert parallelism of a module list sends one tensor of rows [n, H] per call")
        rows = args[0]
        if self.mode == "record":
            self.calls.append((position, rows))
            return torch.zeros_like(rows)
        if self.mode != "replay":
            raise RuntimeError("an expert of an expert-parallel list was called outside its layer's forward")
        return self._replayed(position, rows)

    def _replayed(self, position: int, rows: torch.Tensor) -> torch.Tensor:
        recorded = self.calls[self.at][1] if self.at < len(self.calls) else None
        if recorded is None or self.calls[self.at][0] != position or recorded.shape != rows.shape \
                or not (self.verified or torch.equal(recorded, rows)):
            raise RuntimeError(f"expert {position} called on rows {tuple(rows.shape)} unlike the record pass's "
                               f"{self._recorded()}: the layer's expert calls must not depend on experts' outputs "
                               "(one expert's output fed to another) or on random draws outside torch's generator")
        self.at += 1
        return self.outputs[self.at - 1]

    def _recorded(self) -> str:
        if self.at >= len(self.calls):
            return "no more calls"
        position, rows = self.calls[self.at]
        return f"expert {position} on rows {tuple(rows.shape)}"


class _Call:
    """What the model's code gets for ``experts[i]``: a callable that records or replays."""

    def __init__(self, dispatch: _Dispatch, position: int) -> None:
        self._dispatch, self._position = dispatch, position

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._dispatch.call(self._position, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(nth(self._dispatch.experts, self._position), name)


class _Dispatched:
    """The container as the model's code indexes and iterates it (a list or ``Sequential`` by
    position, a ``ModuleDict`` by key); ``_modules`` (state dict, FSDP, ``get_submodule``) is
    untouched. Mixed into the container's class, swapped in place, as ``fully_shard`` does."""

    _shardplan_dispatch: _Dispatch
    _modules: dict[str, nn.Module]

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, str):  # a ModuleDict's key
            return _Call(self._shardplan_dispatch, list(self._modules).index(idx))
        positions = list(range(len(self._modules)))[idx]
        if isinstance(positions, list):
            return [_Call(self._shardplan_dispatch, p) for p in positions]
        return _Call(self._shardplan_dispatch, positions)

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self, nn.ModuleDict):  # a dict iterates its keys
            return iter(self._modules)
        return iter(self[:])

    def values(self) -> list[Any]:
        return self[:]

    def items(self) -> list[tuple[str, Any]]:
        return list(zip(self._modules, self[:]))


def nth(experts: nn.Module, position: int) -> nn.Module:
    """The container's ``position``-th expert module, whatever it is named."""
    return list(experts._modules.values())[position]


def held_elsewhere(model: nn.Module) -> dict[str, int]:
    """State-dict keys of experts this rank does not hold -> the ep rank that does."""
    out = {}
    for fqn, module in model.named_modules():
        if isinstance(module, RemoteExpert):
            out.update({f"{fqn}.{k}": module.owner for k, _, _ in module.held_state})
    return out


def held_whole(model: nn.Module) -> set[str]:
    """Parameter names of the modules this rank holds whole in lists split over an axis
    (experts over ep, heads over tp): plain tensors, no other rank has them."""
    return {f"{fqn}.{name}" for fqn, module in model.named_modules() if _owners(module) is not None
            for name, _ in module.named_parameters()}


def held_here(model: nn.Module) -> set[str]:
    """Parameter names of the listed experts this rank holds (their gradients are already the
    mean over ep: no data-parallel average over ep for them)."""
    return {f"{fqn}.{name}" for fqn, module in model.named_modules() if isinstance(module, _Dispatched)
            for name, _ in module.named_parameters()}


def gather_listed_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (this rank's, each value already gathered whole) with every expert of
    every dispatched list in it, in the unsharded model's key order: an expert this rank holds
    is broadcast from here over ep, one it does not is received from its owner. Collective."""
    import torch.distributed as dist

    lists = {fqn: m for fqn, m in model.named_modules() if _owners(m) is not None}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        prefix = next((f for f in lists if key.startswith(f"{f}.")), None)
        if prefix is None:
            out[key] = value
        elif not any(k.startswith(f"{prefix}.") for k in out):
            owners = _owners(lists[prefix])
            device = _held_param(lists[prefix]).device  # the group's device (NCCL sends no CPU tensor)
            for position, (name, expert) in enumerate(lists[prefix]._modules.items()):
                for k, shape, dtype in _state_of(expert):
                    full = f"{prefix}.{name}.{k}"
                    t = state[full].to(device) if full in state else torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(t, group=owners.group, group_src=position // owners.local)
                    out[full] = t.to(value.device)
    return out


def _owners(module: nn.Module) -> Owners | None:
    """How a list split whole over an axis is held (None for any other module)."""
    if isinstance(module, _Dispatched):
        return Owners(module._shardplan_dispatch.group, module._shardplan_dispatch.local)
    owners = module.__dict__.get("_shardplan_owners")
    return owners if isinstance(owners, Owners) else None


def _held_param(modules: nn.Module) -> torch.Tensor:
    """The local tensor of the first parameter this rank holds in the list."""
    p = next(next(m for m in modules._modules.values() if not isinstance(m, RemoteExpert)).parameters())
    return p.to_local() if hasattr(p, "to_local") else p


def _state_of(expert: nn.Module) -> list[tuple[str, tuple, torch.dtype]]:
    if isinstance(expert, RemoteExpert):
        return expert.held_state
    return [(k, tuple(t.shape), t.dtype) for k, t in expert.state_dict().items()]


def shard_listed_experts(layer: nn.Module, child: str, ep_mesh: Any) -> None:
    """Whole experts of ``layer.<child>`` over ``ep_mesh``, the layer's forward run as record,
    exchange, replay; see the module doc."""
    experts = getattr(layer, child)
    if not isinstance(experts, EXPERT_CONTAINERS):
        raise ValueError(f"{type(layer).__name__}.{child} is a {type(experts).__name__}; expected the nn.ModuleList "
                         "(or ModuleDict, Sequential) of experts the plan names")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if len(experts) % ep:
        raise ValueError(f"{type(layer).__name__}.{child} has {len(experts)} experts, which ep={ep} does not divide; "
                         f"use an ep that divides {len(experts)}")
    local = len(experts) // ep
    hidden = _in_features(nth(experts, 0))
    for position, name in enumerate(list(experts._modules)):
        if position // local != rank:
            experts._modules[name] = RemoteExpert(position // local, experts._modules[name])
    dispatch = _Dispatch(experts, ep_mesh.get_group(), ep, local, rank * local, hidden)
    experts.__class__ = type("Dispatched" + type(experts).__name__, (_Dispatched, type(experts)), {})
    experts._shardplan_dispatch = dispatch
    layer.forward = partial(_two_passes, layer.forward, dispatch, layer)


def _in_features(expert: nn.Module) -> int:
    """H, the width of the rows an expert takes (:func:`..analyze.graph.rows_width`)."""
    width = rows_width(expert)
    if width is None:
        raise ValueError(f"{type(expert).__name__} has no Linear (in_features) to read its rows' width from; expert "
                         "parallelism of a module list needs experts made of Linears")
    return width


def _two_passes(run: Callable, dispatch: _Dispatch, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    dispatch.mode, dispatch.calls = "record", []
    try:
        with torch.random.fork_rng(devices=_rng_devices()), _buffers_kept(layer):
            run(*args, **kwargs)
        dispatch.outputs = _exchange_calls(dispatch)
        dispatch.mode, dispatch.at = "replay", 0
        out = run(*args, **kwargs)
        if dispatch.at != len(dispatch.calls):
            raise RuntimeError(f"the replay called {dispatch.at} experts where the record pass called "
                               f"{len(dispatch.calls)}: the layer's expert calls must not depend on experts' outputs")
        dispatch.verified = True
        return out
    finally:
        dispatch.mode, dispatch.calls, dispatch.outputs = "idle", [], []


def _rng_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


@contextmanager
def _buffers_kept(layer: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in layer.buffers() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _exchange_calls(d: _Dispatch) -> list[torch.Tensor]:
    """Every recorded call's rows through its expert on the owning rank; the outputs in call
    order. Rows go sorted by expert (so by owner), ``counts[j, e]`` to rank j's expert e."""
    order = sorted(range(len(d.calls)), key=lambda i: d.calls[i][0])
    like = next((r for _, r in d.calls), None)
    empty = torch.zeros(0, d.hidden, requires_grad=torch.is_grad_enabled(),
                        **({"dtype": like.dtype, "device": like.device} if like is not None else _param_kind(d)))
    outgoing = torch.cat([d.calls[i][1] for i in order]) if order else empty
    counts = torch.zeros(d.ep * d.local, dtype=torch.int64, device=outgoing.device)
    for position, rows in d.calls:
        counts[position] += rows.shape[0]
    got, received, sizes = send(outgoing, counts.view(d.ep, d.local), d.group)
    perm = by_expert(received)  # rank j's rows for our expert 0, 1, ..., then rank j + 1's: by expert
    grouped = got[perm].split(received.sum(0).tolist())
    y = torch.cat([_run_local(d, e, rows) for e, rows in enumerate(grouped)])[torch.argsort(perm)]
    back = exchange(y, *sizes, d.group).split([d.calls[i][1].shape[0] for i in order])
    outputs: list[torch.Tensor] = [back[0]] * len(order)
    for slot, i in enumerate(order):
        outputs[i] = back[slot]
    return outputs


def _param_kind(d: _Dispatch) -> dict[str, Any]:
    local = _held_param(d.experts)
    return {"dtype": local.dtype, "device": local.device}


def _run_local(d: _Dispatch, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``first + e`` on its rows, called as a module (FSDP's hooks run). Its parameters'
    gradient comes out / ep, the rows' exact: rows * ep -> expert -> / ep, in backward only."""
    expert = nth(d.experts, d.first + e)
    return ScaleGrad.apply(expert(ScaleGrad.apply(rows, float(d.ep))), 1.0 / d.ep)
