"""DTensor runs: how ``dtensor_weights`` code runs, on meta here and on the ranks alike.

Contract
--------
``ReplicateBeside(mesh)`` is the ``TorchFunctionMode`` that module's code runs under: a plain
tensor read beside a DTensor becomes Replicate, and attention runs on each rank's heads
(:func:`attention`). ``probe_mesh(tp)`` is a mesh of ``tp`` fake ranks for planning: its
collectives run on meta tensors through a named fake group, with no default process group
made or read, so planning is the same with or without one. ``Recorded`` counts the
collectives DTensor issues, by kind and bytes, as the estimate prices them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["ReplicateBeside", "Recorded", "probe_mesh", "attention"]


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
            return attention(args, kwargs)
        return func(*args, **kwargs)


def attention(args: tuple, kwargs: dict) -> Any:
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


_PROBES: dict[int, Any] = {}


def probe_mesh(tp: int) -> Any:
    """A 1-D mesh of ``tp`` ranks, this process rank 0, backed by a fake group registered under
    its own name (``shardplan_probe_{tp}``): DTensor's redistributions run on meta tensors and
    communicate nothing; the default process group, if any, is never touched."""
    from torch.distributed.device_mesh import DeviceMesh

    if tp not in _PROBES:
        # its own axis name: DTensor caches decisions by mesh value, and no user's mesh may be
        # handed this one (a redistribution through the fake group would communicate nothing)
        mesh = DeviceMesh("cpu", torch.arange(tp), mesh_dim_names=("shardplan_probe",), _init_backend=False, _rank=0)
        try:  # torch's private group API (2.13): without it no collective runs, so code that needs one is not offered
            from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup, _register_process_group
            from torch.testing._internal.distributed.fake_pg import FakeStore

            backend = FakeProcessGroup._create_internal(0, tp)
            group = ProcessGroup(FakeStore(), 0, tp)
            for device in ("cpu", "meta"):
                group._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
            group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
            name = f"shardplan_probe_{tp}"
            _register_process_group(name, group)
            mesh._dim_group_names = [name]
        except (ImportError, AttributeError, RuntimeError, TypeError):
            group = None
        _PROBES[tp] = (mesh, group)  # the group is held: the registry does not keep it alive
    _registered(tp)
    return _PROBES[tp][0]


def _registered(tp: int) -> None:
    """Register the probe's group again where ``destroy_process_group`` emptied the registry
    (the local check's fake world ends so): a second plan in the same process found no group,
    its code run on DTensors raised, and its plan differed from the first (Hy-V4's
    ``hc_head`` planned ``dtensor_weights``, then ``replicate``)."""
    group = _PROBES[tp][1]
    if group is None:
        return
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    name = f"shardplan_probe_{tp}"
    try:
        _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        _register_process_group(name, group)


# funcol op -> (kind, whether its first argument is the whole tensor; else a shard gathered)
_COLLECTIVES = {"all_reduce": ("all_reduce", True), "all_gather_into_tensor": ("all_gather", False),
                "reduce_scatter_tensor": ("reduce_scatter", True), "all_to_all_single": ("all_to_all", True)}


class Recorded(TorchDispatchMode):
    """The collectives run inside, as ``(kind, logical bytes)``: an all-gather's gathered
    tensor, a reduction's whole input, as :mod:`.cost` prices them."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp, self.comms = tp, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # let DTensor run first and issue its collectives (CommDebugMode does so)
            return NotImplemented
        name = getattr(func, "_overloadpacket", func).__name__
        if func.namespace in ("_c10d_functional", "c10d_functional") and name in _COLLECTIVES:
            kind, whole = _COLLECTIVES[name]
            t = args[0]
            self.comms.append((kind, t.numel() * t.element_size() * (1 if whole else self.tp)))
        return func(*args, **(kwargs or {}))
