"""Folding for the export front end: repeated blocks run as one opaque op while exporting.

Contract
--------
``Folder(model, groups)`` wraps, for the length of one ``torch.export``, the forward of every
block in ``groups`` (:func:`~shardplan.analyze.trace._repeated_groups`: copy FQN ->
representative): the representative's tensor inputs and outputs pass through
``shardplan::mark`` (an identity :mod:`.export`'s rewrite drops, which says which graph values
its call read and returned), and a copy called as the representative's first call was runs as
``shardplan::folded_block``, returning tensors shaped as the representative's outputs, so its
body is never traced. A copy called otherwise, or a representative whose output is not a
tensor or a flat tuple of tensors and constants, is traced through. ``BlockCall`` records one
call: its pytree spec, which leaves are tensors (``Slot``), and its outputs. The wrapping is on
the blocks' classes (export calls a module registered twice through a proxy, which an
instance attribute would bypass) and is undone on success and on error.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import _AttrProxy
from torch.utils._pytree import tree_flatten, tree_unflatten

from .trace import TraceError

__all__ = ["Folder", "BlockCall", "Slot", "filled", "count_slots", "registered_ops"]

@dataclass(frozen=True)
class Slot:
    """Where a call's tensor sat among its flattened arguments (or outputs)."""

    index: int


@dataclass
class BlockCall:
    """One call of a representative (``copy`` False) or of a folded copy, during the export."""

    fqn: str
    copy: bool
    spec: Any  # the pytree spec of (args, kwargs)
    leaves: list  # its leaves, each tensor as a Slot of its index among the tensors
    example: tuple[tuple, dict] = ((), {})  # (args, kwargs) as called (fake tensors)
    key: tuple = ()
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)  # tensors as Slot, constants as they are
    out_metas: list = field(default_factory=list)  # (shape, stride, dtype) per output tensor
    rep: str = ""  # a copy: the representative whose outputs it returns


_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


class Folder:
    """Wraps the forwards of repeated blocks for one export: representatives mark their
    tensor inputs and outputs, copies whose inputs match the representative's first call
    become one ``shardplan::folded_block`` op. ``folded`` maps copy -> representative."""

    def __init__(self, model: nn.Module, folded: dict[str, str]) -> None:
        self.model, self.folded = model, folded
        self.calls: dict[int, BlockCall] = {}  # call id (unique in the process) -> the call
        self.first: dict[str, BlockCall] = {}  # representative -> its first call, when copies may reuse it

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The blocks' classes answer ``forward`` through :meth:`_forward` for these modules
        (by class, not on the instance: where a module is shared, export calls ``forward``
        on a proxy of it, whose submodules it names by the path it was reached by)."""
        roles = {id(self.model.get_submodule(f)): f for f in set(self.folded) | set(self.folded.values())}
        classes = {type(self.model.get_submodule(f)) for f in roles.values()}
        saved = {cls: (cls.__dict__.get("forward", _MISSING), cls.forward) for cls in classes}
        try:
            for cls, (_, original) in saved.items():
                cls.forward = self._dispatch(roles, cls, original)
            if roles:
                _ops()
            yield
        finally:
            for cid in self.calls:
                _FOLDER_CALLS.pop(cid, None)
            for cls, (own, _) in saved.items():
                if own is _MISSING:
                    delattr(cls, "forward")
                else:
                    cls.forward = own

    def _dispatch(self, roles: dict[int, str], cls: type, original: Any) -> Any:
        folder = self

        @functools.wraps(original)
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            base = module.get_base() if isinstance(module, _AttrProxy) else module
            fqn = roles.get(id(base)) if type(base) is cls else None
            if fqn is None:  # another instance, or a subclass's super().forward(): the class's own
                return original(module, *args, **kwargs)
            run = functools.partial(original, module)
            if fqn in folder.folded:
                return folder._copy_forward(fqn, run, args, kwargs)
            return folder._rep_forward(fqn, run, args, kwargs)

        return forward

    def _record(self, fqn: str, copy: bool, args: tuple, kwargs: dict) -> tuple[BlockCall, list]:
        flat, spec = tree_flatten((args, kwargs))
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        slots, leaves = iter(range(len(tensors))), []
        for v in flat:
            leaves.append(Slot(next(slots)) if isinstance(v, torch.Tensor) else v)
        call = BlockCall(fqn, copy, spec, leaves, key=(str(spec), tuple(_leaf_key(v) for v in flat)))
        return call, tensors

    def _rep_forward(self, fqn: str, forward: Any, args: tuple, kwargs: dict) -> Any:
        """Marks the representative's tensor inputs and outputs; keeps its first call's."""
        call, tensors = self._record(fqn, False, args, kwargs)
        cid = next(_CALL_IDS)
        self.calls[cid] = call
        call.example = (args, kwargs)  # fakes: made meta after the export, untraced
        mark = _ops()[0]
        inputs = [mark(t, cid, i) if _markable(t) else t for i, t in enumerate(tensors)]
        args, kwargs = tree_unflatten(filled(call.leaves, inputs), call.spec)
        out = forward(*args, **kwargs)
        leaves, call.out_spec = tree_flatten(out)
        outs = [v for v in leaves if isinstance(v, torch.Tensor)]
        slots = iter(range(len(outs)))
        call.out_leaves = [Slot(next(slots)) if isinstance(v, torch.Tensor) else v for v in leaves]
        call.out_metas = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outs]
        if fqn not in self.first and _reusable(out, call):
            self.first[fqn] = call
        marked = [mark(t, cid, -1 - i) if _markable(t) else t for i, t in enumerate(outs)]
        return tree_unflatten(filled(call.out_leaves, marked), call.out_spec)

    def _copy_forward(self, fqn: str, forward: Any, args: tuple, kwargs: dict) -> Any:
        """One ``shardplan::folded_block`` op where the inputs match the representative's."""
        rep = self.first.get(self.folded[fqn])
        call, tensors = self._record(fqn, True, args, kwargs)
        if rep is None or not tensors or call.key != rep.key:
            return forward(*args, **kwargs)  # other inputs than the representative's: traced through
        call.rep, call.out_spec, call.out_leaves, call.out_metas = rep.fqn, rep.out_spec, rep.out_leaves, rep.out_metas
        call.example = (args, kwargs)
        cid = next(_CALL_IDS)
        self.calls[cid] = call
        _FOLDER_CALLS[cid] = call.out_metas
        outs = _ops()[1](tensors, cid)
        return tree_unflatten(filled(call.out_leaves, outs), call.out_spec)


_MISSING = object()


def _markable(t: torch.Tensor) -> bool:
    # a Parameter handed to a block stays itself (code may test isinstance(p, nn.Parameter))
    return not isinstance(t, nn.Parameter)


def count_slots(leaves: list) -> int:
    return sum(isinstance(v, Slot) for v in leaves)


def filled(leaves: list, tensors: list) -> list:
    return [tensors[v.index] if isinstance(v, Slot) else v for v in leaves]


def _leaf_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        shape = tuple(int(n) if isinstance(n, int) or not isinstance(n, torch.SymInt) else repr(n) for n in v.shape)
        return ("tensor", shape, v.dtype)
    return (type(v).__qualname__, repr(v))


def _reusable(out: Any, call: BlockCall) -> bool:
    """Copies may return the representative's outputs: a tensor, or a flat tuple or list of
    tensors and constants, of sizes known as numbers (not a data-dependent size)."""
    items = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else None
    if not items or not any(isinstance(v, torch.Tensor) for v in items):
        return False
    if not all(isinstance(v, torch.Tensor) or isinstance(v, _CONSTANTS) for v in items):
        return False
    return all(type(n) is int for shape, stride, _ in call.out_metas for n in (*shape, *stride))


_OPS: tuple | None = None
_FOLDER_CALLS: dict[int, list] = {}  # a folded copy's call id -> its outputs' (shape, stride, dtype)
_CALL_IDS = itertools.count()


def _ops() -> tuple:
    """``shardplan::mark`` (an identity the rewrite drops) and ``shardplan::folded_block``
    (a copy's call: outputs shaped as its representative's), made once per process."""
    global _OPS
    if _OPS is not None:
        return _OPS

    @torch.library.custom_op("shardplan::mark", mutates_args=())
    def mark(x: torch.Tensor, call: int, slot: int) -> torch.Tensor:
        return x.clone()

    @mark.register_fake
    def _(x, call, slot):
        return torch.empty_like(x)

    mark.register_autograd(lambda ctx, grad: (grad, None, None))

    @torch.library.custom_op("shardplan::folded_block", mutates_args=())
    def folded_block(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
        return _block_outputs(inputs, call)

    @folded_block.register_fake
    def _(inputs, call):
        return _block_outputs(inputs, call)

    _OPS = (mark, folded_block)
    return _OPS


def _block_outputs(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    metas = _FOLDER_CALLS.get(call)
    if metas is None:
        raise TraceError("shardplan::folded_block called outside shardplan's export")
    return [inputs[0].new_empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in metas]


# --------------------------------------------------------------------------- inlining


def registered_ops() -> tuple | None:
    """``(mark, folded_block)`` once an export registered them; None before."""
    return _OPS
