"""Load: a model built on the meta device and sharded by ``apply_plan`` gets real shards,
and never exists whole on any rank.

Contract
--------
``materialize(model, *, device=None, init=None, seed=None)`` allocates only each rank's
local shards (``model.to_empty``) and initializes them with ``init(model)`` if given, else
the model's own initializer: Hugging Face's ``init_weights()`` (its ``_init_weights`` per
module), a torchtitan-style ``model.init_weights()``, else every module's
``reset_parameters()``. Each rank ends with its shard of the *same* global tensors one
process gets from the same seed and the same initializer on the unsharded model, exactly:

* a module's ``reset_parameters()`` or a Hugging Face ``_init_weights(module)`` runs on
  plain, full-size copies of that module's own DTensors (one module at a time, so the peak
  is the largest module, not the model); each rank then keeps its slice. Any init code
  inside them is exact, padding rows and ``orthogonal_`` included;
* an in-place random fill that reaches a DTensor anywhere else (a torchtitan
  ``init_weights`` calling ``trunc_normal_(self.wq.weight)``, a user's ``init=``) draws the
  full tensor and keeps the slice; element-wise follow-ups (``erfinv_``, ``clamp_``...)
  run on the shard. Only non-element-wise code there (``orthogonal_`` on a sharded weight)
  runs under DTensor's own semantics.

So every rank draws every full tensor: the init costs one process's init time on each rank.
Every rank must start from the same random state: ``seed=`` seeds torch on every rank, and
without it the ranks' generator states are compared (one small all-gather) and a mismatch
is a ``ValueError``. Non-persistent buffers (RoPE tables: never in checkpoints) are left
garbage by ``to_empty``; the initializer must rebuild them (Hugging Face rotary embeddings
are rebuilt by their own ``_init_weights`` if ``init=`` did not). Every float tensor is
filled with NaN before the init and checked after it: a parameter or buffer the
initializer left (even partly) unset is a ``ValueError`` naming it, never silent garbage.
Forward hooks and the gradient machinery ``apply_plan`` installed survive (``to_empty``
keeps the parameter objects and the modules).

``load_checkpoint(model, path, *, strict=True)`` reads a safetensors checkpoint (a
``model.safetensors`` file, or a sharded one with ``model.safetensors.index.json``) into
the model, each rank reading only the elements of its own shards
(``safe_open(...).get_slice(name)[...]``): the index ranges come from each DTensor's
placements and mesh coordinate, computed by DTensor itself on a 1-D index per dim
(:func:`.state.local_runs`, which DCP's chunks of packed weights come from too), so
``Shard``, uneven shards and packed ``_StridedShard`` weights (one range per part) need no
per-style code. Keys are the model's ``state_dict()`` names; a tied weight needs one of its
names in the file. Values are cast to each tensor's dtype. No communication.

Both cut slices at each mesh's ``get_coordinate()``; that a mesh made after planning reports
this rank's coordinate is :func:`shardplan.apply.mesh.fake_process_group`'s job (it drops
DTensor's cached meshes with the fake group; tested in ``tests/test_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .experts_listed import held_elsewhere
from .packed import distribute
from .state import local_runs

__all__ = ["materialize", "load_checkpoint"]


# --------------------------------------------------------------------------- materialize


def materialize(model: nn.Module, *, device: str | torch.device | None = None,
                init: Callable[[nn.Module], Any] | None = None, seed: int | None = None) -> nn.Module:
    """Allocate ``model``'s local shards on ``device`` and initialize them; returns the model.

    ``device=None`` is the device of the model's mesh (the current CUDA device for an
    NCCL mesh, the CPU for gloo), or the CPU for a model without DTensors. Call it on every
    rank (see the module doc)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"materialize needs an nn.Module; got {type(model).__name__}")
    if init is not None and not callable(init):
        raise ValueError(f"init must be a callable taking the model; got {type(init).__name__}")
    _check_on_meta(model)
    target = _device(model, device)
    with torch.no_grad():
        model.to_empty(device=target)
        slots = _mark_unset(model)
    if seed is not None:
        torch.manual_seed(seed)
    _check_same_rng(target)
    what, run = _initializer(model, init)
    with torch.no_grad(), _exact_init(model):
        run()
        _rebuild_hf_buffers(model, slots)
    _check_set(slots, what)
    return model


def _check_on_meta(model: nn.Module) -> None:
    tensors = [*model.parameters(), *model.buffers()]
    if not any(_local(t).is_meta for t in tensors):
        where = tensors[0].device if tensors else "nowhere (no parameters)"
        raise ValueError(f"materialize: {type(model).__name__} is not on the meta device (its tensors are on {where}); "
                         "it allocates and initializes a model built under `with torch.device('meta')` and sharded "
                         "with apply_plan. Load weights into a real model with load_checkpoint instead")


def _device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    kinds = {t.device_mesh.device_type for t in model.parameters() if isinstance(t, DTensor)}
    if device is not None:
        device = torch.device(device)
        if kinds and device.type not in kinds:
            raise ValueError(f"materialize: device={str(device)!r} but the model's DTensors live on a "
                             f"{'/'.join(sorted(kinds))} mesh; pass device={sorted(kinds)[0]!r} or leave device=None")
        return device
    if not kinds or kinds == {"cpu"}:
        return torch.device("cpu")
    kind = sorted(kinds)[0]
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _initializer(model: nn.Module, init: Callable[[nn.Module], Any] | None) -> tuple[str, Callable[[], Any]]:
    """(what it is, for messages; a call that runs it)."""
    if init is not None:
        return f"init={getattr(init, '__qualname__', repr(init))}", partial(init, model)
    if _is_hf(model):
        return f"{type(model).__name__}.init_weights() (transformers)", partial(_hf_init, model)
    if callable(getattr(model, "init_weights", None)):
        return f"{type(model).__name__}.init_weights()", model.init_weights
    return "each module's reset_parameters()", partial(_reset_all, model)


def _is_hf(model: nn.Module) -> bool:
    return callable(getattr(model, "_init_weights", None)) and callable(getattr(model, "initialize_weights", None))


def _hf_init(model: nn.Module) -> None:
    # transformers skips whatever carries _is_hf_initialized; after to_empty nothing is initialized
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)
    # One process's to_empty unties tied weights (a new tensor per owner); transformers then
    # initializes both and re-ties the target to the source, so the source's draw wins (the
    # target's is drawn and dropped). The tie survives to_empty here: give each tied target
    # a scratch shard to draw into for the same result, then tie it back.
    ties = []
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        shared = model.get_parameter(source)
        if model.get_parameter(target) is shared:
            owner, name = model.get_submodule(target.rpartition(".")[0]), target.rpartition(".")[2]
            owner._parameters[name] = nn.Parameter(torch.empty_like(shared), requires_grad=shared.requires_grad)
            ties.append((owner, name, shared))
    try:
        model.init_weights()
    finally:
        for owner, name, shared in ties:
            owner._parameters[name] = shared


def _reset_all(model: nn.Module) -> None:
    for module in model.modules():
        if callable(getattr(type(module), "reset_parameters", None)):
            module.reset_parameters()


# --- exact initialization -----------------------------------------------------------------


def _full_slice(target: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``target`` lays it out (a local cut: every rank has
    ``full``, so nothing is sent)."""
    return distribute(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


class _RandomToFull(TorchDispatchMode):
    """An in-place random fill of a DTensor draws the whole global tensor from the
    generator, as one process does, and keeps this rank's slice: the generator advances by
    the same amount on every rank and in the one process, so later draws agree as well."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, DTensor) and _is_random_fill(func):
            local = target._local_tensor  # inside dispatch: no autograd-level to_local
            full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
            func(full, *args[1:], **kwargs)
            local.copy_(_full_slice(target, full))
            return target
        return func(*args, **kwargs)


def _is_random_fill(func: Any) -> bool:
    first = func._schema.arguments[0] if func._schema.arguments else None
    writes = first is not None and first.alias_info is not None and first.alias_info.is_write
    return writes and torch.Tag.nondeterministic_seeded in func.tags


@contextlib.contextmanager
def _exact_init(model: nn.Module) -> Iterator[None]:
    """Wrap each module's ``reset_parameters`` and each Hugging Face ``_init_weights`` so
    they run on full-size plain copies (instance attributes shadow the methods; removed
    after), and catch random fills of DTensors everywhere else."""
    wrapped: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if callable(getattr(type(module), "reset_parameters", None)):
            object.__setattr__(module, "reset_parameters", partial(_on_full, module.reset_parameters, module))
            wrapped.append((module, "reset_parameters"))
        if _is_hf(module):
            original = module._init_weights
            object.__setattr__(module, "_init_weights", lambda m, _f=original: _on_full(partial(_f, m), m))
            wrapped.append((module, "_init_weights"))
    try:
        with _RandomToFull():
            yield
    finally:
        for module, name in wrapped:
            module.__dict__.pop(name, None)


def _on_full(fn: Callable[[], Any], module: nn.Module) -> Any:
    """Run ``fn`` (an initializer of ``module``) with ``module``'s own DTensors swapped for
    NaN-filled full-size plain tensors, then copy each rank's slice back."""
    swapped = {}
    for store in (module._parameters, module._buffers):
        for name, t in store.items():
            if isinstance(t, DTensor):
                full = torch.full(t.shape, math.nan, dtype=t.dtype, device=t.to_local().device) if t.is_floating_point() \
                    else torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
                swapped[(id(store), name)] = (store, name, t)
                store[name] = nn.Parameter(full, requires_grad=t.requires_grad) if store is module._parameters else full
    try:
        return fn()
    finally:
        for store, name, t in swapped.values():
            _scatter_back(t, store[name])
            store[name] = t


def _scatter_back(target: DTensor, full: torch.Tensor) -> None:
    full = full.detach()
    if full.is_floating_point() and torch.isnan(full).any():
        # the initializer wrote part of it (one process keeps the rest as it was): keep the
        # current values there. Every rank draws the same full tensor, so every rank takes
        # this branch together and the gather is collective.
        full = torch.where(torch.isnan(full), target.full_tensor().to(full.dtype), full)
    target.to_local().copy_(_full_slice(target, full))


# --- agreement and the unset check -----------------------------------------------------------


def _gather(obj: Any) -> list[Any]:
    """``obj`` from every rank (just ``[obj]`` without a real process group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_same_rng(device: torch.device) -> None:
    state = torch.get_rng_state()
    if device.type != "cpu":
        state = torch.cat([state, torch.get_device_module(device.type).get_rng_state()])
    digests = _gather(hashlib.sha256(state.numpy().tobytes()).hexdigest())
    if len(set(digests)) > 1:
        groups = sorted({d: [r for r, x in enumerate(digests) if x == d] for d in digests}.values())
        raise ValueError(f"materialize: the ranks' random generators differ (ranks grouped by state: {groups}), so "
                         "their shards would come from different global tensors; pass seed= to materialize, or call "
                         "torch.manual_seed(seed) with the same seed on every rank first")


@dataclass
class _Slot:
    """A parameter or buffer as ``to_empty`` left it, to see afterwards whether it was set."""

    fqn: str
    owner: nn.Module
    name: str
    kind: str  # "parameter", "buffer", "non-persistent buffer"
    tensor: torch.Tensor
    version: int

    def unset(self) -> bool:
        now = (self.owner._parameters if self.kind == "parameter" else self.owner._buffers).get(self.name)
        if now is not self.tensor:
            return False  # the initializer assigned a new tensor (``self.rope_cos = cos``)
        if now.is_floating_point():
            return bool(torch.isnan(_local(now)).any())
        return now._version == self.version  # integers cannot hold NaN: was it written at all?


def _mark_unset(model: nn.Module) -> list[_Slot]:
    slots, seen = [], set()
    for fqn, module in model.named_modules():
        for kind, store in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in store.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if kind == "buffer" and name in module._non_persistent_buffers_set:
                    kind_here = "non-persistent buffer"
                else:
                    kind_here = kind
                if t.is_floating_point():
                    _local(t).fill_(math.nan)
                slots.append(_Slot(f"{fqn}.{name}" if fqn else name, module, name, kind_here, t, t._version))
    return slots


def _rebuild_hf_buffers(model: nn.Module, slots: list[_Slot]) -> None:
    """A Hugging Face module holding only buffers (a rotary embedding's ``inv_freq``) that
    the initializer left unset is rebuilt by transformers' own ``_init_weights``; it has no
    parameters, so nothing the initializer set is drawn again."""
    if not _is_hf(model):
        return
    owners = {id(s.owner): s.owner for s in slots if s.kind == "non-persistent buffer" and s.unset()}
    for owner in owners.values():
        if not list(owner.parameters(recurse=False)):
            model._init_weights(owner)


def _check_set(slots: list[_Slot], what: str) -> None:
    unset = sorted(set().union(*_gather([f"{s.fqn} ({s.kind} of {type(s.owner).__name__})" for s in slots if s.unset()])))
    if unset:
        more = f" and {len(unset) - 5} more" if len(unset) > 5 else ""
        raise ValueError(
            f"materialize: {what} left {len(unset)} tensors unset (still the garbage to_empty allocates): "
            f"{'; '.join(unset[:5])}{more}. Pass init= a callable that sets them (non-persistent buffers such as "
            "RoPE tables are in no checkpoint, so the init must rebuild them), or give the module a reset_parameters()"
        )


# --------------------------------------------------------------------------- load_checkpoint


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Read the safetensors checkpoint at ``path`` (a folder, a ``.safetensors`` file or a
    ``.safetensors.index.json``) into ``model``, each rank reading only its own slices;
    returns the model. ``strict=False`` loads the keys that match and skips the rest."""
    import safetensors

    if not isinstance(model, nn.Module):
        raise ValueError(f"load_checkpoint needs an nn.Module; got {type(model).__name__}")
    where = _weight_map(os.fspath(path))
    own = model.state_dict(keep_vars=True)
    todo, missing = _match_keys(own, where)
    unexpected = sorted(set(where) - set(own) - set(held_elsewhere(model)))  # other ep ranks' experts
    if strict and (missing or unexpected):
        raise _key_error(model, os.fspath(path), missing, unexpected)
    by_file: dict[str, list[str]] = {}
    for key in todo:
        by_file.setdefault(where[key], []).append(key)
    with torch.no_grad():
        for file, keys in by_file.items():
            with safetensors.safe_open(file, framework="pt") as f:
                for key in keys:
                    _read_into(key, f.get_slice(key), todo[key], file)
    return model


def _weight_map(path: str) -> dict[str, str]:
    """``{key: file}`` of the checkpoint at ``path``."""
    index = path if path.endswith(".json") else os.path.join(path, "model.safetensors.index.json")
    single = path if path.endswith(".safetensors") else os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"load_checkpoint: {index} has no 'weight_map' object; expected a safetensors index "
                             "as save_pretrained writes it ({'weight_map': {key: file}})")
        return {k: os.path.join(os.path.dirname(index), v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        import safetensors

        with safetensors.safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    found = sorted(os.listdir(path))[:8] if os.path.isdir(path) else "no such folder"
    raise ValueError(f"load_checkpoint: no safetensors checkpoint at {path!r} (found: {found}); expected a folder with "
                     "model.safetensors or model.safetensors.index.json, or the path of one. Other formats (.bin): "
                     "convert with safetensors.torch.save_model on one machine first")


def _match_keys(own: dict[str, torch.Tensor], where: dict[str, str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """({file key: tensor to fill}, missing keys). The names of one tied tensor share it:
    the first present is read, the tensor is filled once (the file holds one of them)."""
    names: dict[int, list[str]] = {}
    for key, t in own.items():
        names.setdefault(id(t), []).append(key)
    todo, missing = {}, []
    for keys in names.values():
        hit = next((k for k in keys if k in where), None)
        if hit is None:
            missing += keys
        else:
            todo[hit] = own[hit]
    return todo, sorted(missing)


def _key_error(model: nn.Module, path: str, missing: list[str], unexpected: list[str]) -> ValueError:
    def few(keys: list[str]) -> str:
        return f"{len(keys)} {keys[:4]}{' ...' if len(keys) > 4 else ''}"

    hint = _hf_layout_hint(model) if unexpected else ""
    return ValueError(
        f"load_checkpoint: {path} does not match {type(model).__name__}.state_dict(): missing {few(missing)}, "
        f"unexpected {few(unexpected)}. {hint}Keys must be named as model.state_dict() names them; pass strict=False "
        "to load only the keys that match (the rest keep their initial values)"
    )


def _hf_layout_hint(model: nn.Module) -> str:
    """What to do when transformers stores this model in another layout than its modules'."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:
        return ""
    types = sorted({m.config.model_type for m in model.modules()
                    if _is_hf(m) and extract_weight_conversions_for_model(m) is not None})
    if not types and not any(getattr(m, "_checkpoint_conversion_mapping", None) for m in model.modules()):
        return ""
    return (f"transformers saves {', '.join(types) or type(model).__name__} checkpoints in another layout than the "
            "modules' (from_pretrained converts them at load, e.g. per-expert weights into one expert bank), which "
            "load_checkpoint does not do. Load it with from_pretrained(path, tp_plan=plan.to_hf_tp_plan()), or "
            "convert it once in module layout (from_pretrained on one machine, then "
            "safetensors.torch.save_model(model, 'converted/model.safetensors')). ")


def _read_into(key: str, piece: Any, target: torch.Tensor, file: str) -> None:
    """Copy this rank's elements of ``key`` from the safetensors slice ``piece``."""
    shape = tuple(piece.get_shape())
    if shape != tuple(target.shape):
        raise ValueError(f"load_checkpoint: {key!r} in {file} has shape {shape}; the model's is {tuple(target.shape)} "
                         "(the global shape, also for a sharded tensor): the checkpoint is of another model config")
    local = _local(target)
    if local.is_meta:
        raise ValueError(f"load_checkpoint: {key!r} is on the meta device; allocate the model first with "
                         "shardplan.materialize(model)")
    if local.ndim == 0:
        local.copy_(piece[...])
        return
    for block in itertools.product(*local_runs(target)):
        # block: per dim (offset in the local shard, start, stop in the global tensor)
        dst = local[tuple(slice(o, o + b - a) for o, a, b in block)]
        dst.copy_(piece[tuple(slice(a, b) for _, a, b in block)])
