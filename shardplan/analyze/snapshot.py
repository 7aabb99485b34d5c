"""Snapshot: the user's model exactly as it was, whatever planning ran of its code.

Contract
--------
``preserved(model)`` is a context manager: on exit, on success or on error, every module
``model`` held on entry has the ``__dict__`` it had then. Planning runs the user's forward
(the meta fx tracer, torch.export on fake tensors, example values on CPU, sharding probes),
and forward code writes to its modules: a RoPE table filled on the first call (``self.cos =
...``, ``register_buffer``), a memo dict keyed by sequence length, a call counter, a hook;
left there, a tracer's proxy or a fake or meta tensor would answer the user's next real
forward. The record is shallow and by identity: every ``__dict__`` entry (``_parameters``,
``_buffers``, ``_modules``, the hook dicts, ``_non_persistent_buffers_set``, plain
attributes) gets back the very object it held, entries added since are removed, and a dict,
list or set held there is refilled in place with the items it held, so the user's own
container objects stay. ``preserved(model, values=True)`` (planning's outermost guard) also
keeps the values of the tensors modules hold that are not parameters (buffers, tensor
attributes), off the meta device: forward code may write into one in place where tracing
runs it eagerly (torchtune's ``self.cache_pos.add_(seq_len)``), and a written one (its
version counter moved) gets its values back. ``snapshot(model).restore()`` puts the model back at a chosen moment (the front ends do,
between the fx tracer and torch.export). Nothing is written where nothing changed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["Snapshot", "preserved", "snapshot"]

_CONTAINERS = (dict, list, set)
_MISSING = object()


@dataclass(frozen=True)
class _Entry:
    """One ``__dict__`` entry: the object, and a container's items (else None)."""

    value: Any
    items: tuple | None


@dataclass(frozen=True)
class Snapshot:
    """Each module's ``__dict__`` entries as they were; :meth:`restore` puts them back."""

    modules: tuple[tuple[nn.Module, dict[str, _Entry]], ...]
    # (tensor, its version counter, a copy of its values) for each tensor whose values are kept
    values: tuple[tuple[torch.Tensor, int, torch.Tensor], ...] = ()

    def restore(self) -> None:
        for module, entries in self.modules:
            _restore_module(module, entries)
        with torch.no_grad():
            for tensor, version, copy in self.values:
                if tensor._version != version:
                    tensor.copy_(copy)


def snapshot(model: Any, *, values: bool = False) -> Snapshot:
    """The state of every module of ``model`` now (nothing for an object that is not a module)."""
    modules = list(model.modules()) if isinstance(model, nn.Module) else []
    return Snapshot(tuple((m, _record(m)) for m in modules), _values(modules) if values else ())


def _values(modules: list[nn.Module]) -> tuple[tuple[torch.Tensor, int, torch.Tensor], ...]:
    held = {id(t): t for m in modules for t in [*m._buffers.values(), *vars(m).values()]
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not t.is_meta}
    return tuple((t, t._version, t.detach().clone()) for t in held.values())


@contextlib.contextmanager
def preserved(model: Any, *, values: bool = False) -> Iterator[Snapshot]:
    """``model`` as it was on entry, once the body is done, whether it returned or raised."""
    state = snapshot(model, values=values)
    try:
        yield state
    finally:
        state.restore()


def _record(module: nn.Module) -> dict[str, _Entry]:
    return {name: _Entry(value, _items(value)) for name, value in vars(module).items()}


def _items(value: Any) -> tuple | None:
    if isinstance(value, dict):
        return tuple(value.items())
    if isinstance(value, _CONTAINERS):
        return tuple(value)
    return None


def _restore_module(module: nn.Module, entries: dict[str, _Entry]) -> None:
    """Written to ``__dict__`` directly: ``nn.Module.__setattr__`` would file a tensor
    under ``_buffers`` or a module under ``_modules``."""
    state = vars(module)
    for name in [n for n in state if n not in entries]:
        del state[name]
    for name, entry in entries.items():
        if state.get(name, _MISSING) is not entry.value:
            state[name] = entry.value
        if entry.items is not None and _changed(entry.value, entry.items):
            _refill(entry.value, entry.items)


def _changed(container: Any, items: tuple) -> bool:
    """Whether ``container`` holds other items than ``items``, by identity (never ``==``: a
    tensor's is elementwise)."""
    now = _items(container) or ()
    if len(now) != len(items):
        return True
    if isinstance(container, set):  # unordered: the same items, each still in it
        return any(item not in container for item in items)
    if isinstance(container, dict):
        return any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(now, items))
    return any(a is not b for a, b in zip(now, items))


def _refill(container: Any, items: tuple) -> None:
    if isinstance(container, list):
        container[:] = items
        return
    container.clear()
    container.update(items)
