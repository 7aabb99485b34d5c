"""Op strategies read off DTensor's own sharding propagation, for ops the hand rules lack.

Contract
--------
``dtensor_strategies(op, graph, tp=...)`` returns the ``(inputs, output)`` placement pairs
(``"R"``/``"S{d}"``) under which DTensor runs ``op`` with no collective, each also checked
to hold for *local* tensors: between weight modules activations are plain tensors, so the
op, run on the local shapes with the same constant arguments, must give the local shape of
DTensor's result (a literal global size, ``reshape(2, 16, 32, 64)``, fails that check).

DTensor knows the sharding rule of every op it supports (``view_as_complex``, ``einsum``,
``roll``, ``repeat_interleave``, ``namedtuple.values``...); typing them here would drift.
The probe runs the op on meta DTensors over a mesh that has no process group
(``_init_backend=False``, rank 0): DTensor computes placements and shapes only, and any
redistribution it would need fails for want of a group, which marks the strategy invalid.
So the answer never depends on whether the caller has a process group, nor on its rank.
Answers are cached by op signature (target, input shapes and dtypes, constant arguments,
tp): a model's repeated ops are probed once per process.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from ..analyze.graph import Op, OpGraph

__all__ = ["dtensor_strategies", "in_place_strategies", "metadata_only", "quiet_probes"]

# attributes that read no element and no size: any placement of the tensor gives the same
# answer on every rank (``x.shape`` does not qualify: a shard's shape is local)
_METADATA_ATTRS = {"device", "dtype", "is_cuda", "is_meta", "requires_grad", "layout", "ndim", "is_floating_point"}
_MAX_COMBOS = 48
_cache: dict[tuple, tuple[tuple[tuple[str, ...], str], ...]] = {}
_meshes: dict[int, Any] = {}


# torch logs what a probe is expected to hit: DTensor's gloo all-to-all fallback, meta
# kernels that refuse a dtype; the probe's answer is the exception, not the log line
_NOISY_LOGGERS = ("torch.distributed.tensor._collective_utils", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def quiet_probes() -> Iterator[None]:
    """Silence warnings and torch's log lines while running code only to see if it runs (on
    the meta device, where ``torch.autocast`` is taken as cpu's)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings(), _autocast_on_meta(), _meta_is_traced():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


@contextlib.contextmanager
def _meta_is_traced() -> Iterator[None]:
    """Hugging Face's mask code takes value-dependent shortcuts (``if not is_tracing(mask) and
    (mask[:, -1] == 0).all()``) unless it is traced; a meta tensor has no values, so it counts
    as traced, as the tracer's proxies and export's fake tensors do (the shortcut is an
    optimization: the mask it builds otherwise is the same). Only a loaded transformers is
    patched; nothing is imported."""
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "is_tracing", None)
    if original is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return original(tensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)

    module.is_tracing = is_tracing
    try:
        yield
    finally:
        module.is_tracing = original


@contextlib.contextmanager
def _autocast_on_meta() -> Iterator[None]:
    """``torch.autocast(x.device.type, enabled=False)`` around a computation (x-transformers'
    rotary frequencies) raises for ``"meta"`` in torch 2.13; meta tensors take no kernel, so
    cpu's autocast stands in and the code around it runs as it would."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__init__

    def init(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        original(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    autocast.__init__ = init
    try:
        yield
    finally:
        autocast.__init__ = original


def metadata_only(op: Op) -> bool:
    """``x.device``, ``x.dtype``...: the op reads nothing a shard changes."""
    node = op.node
    if node.op == "call_function" and op.target == "getattr" and len(node.args) == 2:
        return node.args[1] in _METADATA_ATTRS
    return node.op == "call_method" and op.target in {"dim", "is_floating_point", "is_contiguous", "get_device"}


def dtensor_strategies(op: Op, graph: OpGraph, *, tp: int) -> list[tuple[tuple[str, ...], str]]:
    """Placements DTensor propagates shard-locally for ``op``; see the module docstring."""
    key = _signature(op, graph, tp)
    if key is None:
        return []
    if key not in _cache:
        _cache[key] = tuple(_probe_all(op, graph, tp))
    return list(_cache[key])


def in_place_strategies(op: Op, graph: OpGraph, *, tp: int) -> list[tuple[str, ...]]:
    """Input placements under which DTensor runs an in-place op with no result
    (``t[:, :, i] = v``, ``operator.setitem``) with no collective, the written tensor keeping
    its placement, and the same write on the local shards runs (a whole ``v`` written into a
    shard of ``t`` is a slice DTensor makes for free, but plain local code would not)."""
    if not is_in_place(op):
        return []
    key = _signature(op, graph, tp)
    if key is None:
        return []
    key = _any_int_index(key)
    if key not in _cache:
        _cache[key] = tuple((combo, "") for combo in _in_place_all(op, graph, tp))
    return [combo for combo, _ in _cache[key]]


def _any_int_index(key: tuple) -> tuple:
    """The signature with the integers of the index spelled alike: which dims an index picks
    one entry of decides where the write is local, not which entry (a chunk loop writes
    ``out[:, :, i]`` for every ``i``; each would be probed again)."""
    node_op, target, (args, kwargs), tp = key

    def norm(a):
        if isinstance(a, tuple) and a[:1] == ("C",) and len(a) == 2 and a[1].lstrip("-").isdigit():
            return ("C", "int")
        return tuple(norm(x) for x in a) if isinstance(a, tuple) else a

    return (node_op, target, (args[:1] + (norm(args[1]),) + args[2:], kwargs), tp)


def is_in_place(op: Op) -> bool:
    """An op that writes into its first tensor argument and returns nothing to the graph."""
    node = op.node
    return op.output is None and bool(op.inputs) and node.op == "call_function" and node.target is operator.setitem


def _in_place_all(op: Op, graph: OpGraph, tp: int) -> list[tuple[str, ...]]:
    choices = [_candidates(graph.values[v].shape, tp) for v in op.inputs]
    combos = [c for c in itertools.product(*choices) if c[0] != "R"][:_MAX_COMBOS]
    with quiet_probes():  # once for all the combinations: entering it costs more than a probe
        return [c for c in combos if _probe_in_place(op, graph, tp, dict(zip(op.inputs, c)))]


def _probe_in_place(op: Op, graph: OpGraph, tp: int, placement: dict[int, str]) -> bool:
    from torch.distributed.tensor.debug import CommDebugMode

    try:
        with torch.no_grad():  # the plain write first: it is cheap, and refuses most
            local = _args(op, placement, tp, distributed=False)
            if not _broadcasts_into(*local[0][:3]):
                return False
            _call(op, graph, local)
        with torch.no_grad(), CommDebugMode() as comm:
            args, kwargs = _args(op, placement, tp, distributed=True)
            before = args[0].placements
            _call(op, graph, (args, kwargs))
    except Exception:  # noqa: BLE001 - DTensor refusing (or the local write failing) is the answer "no"
        return False
    return not comm.get_total_counts() and args[0].placements == before


def _signature(op: Op, graph: OpGraph, tp: int) -> tuple | None:
    node, tensors = op.node, set(op.inputs)
    if node.op not in ("call_function", "call_method", "call_module") or (op.output is None and not is_in_place(op)):
        return None
    if node.op == "call_module" and _has_state(graph, node.target):
        return None  # a module with weights or buffers is not an op DTensor can run alone

    def sig(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            i = a.meta.get("shardplan_op")
            if i in tensors:
                v = graph.values[i]
                return ("T", v.shape, str(v.dtype))
            a = a.meta.get("val")
        if isinstance(a, (tuple, list)):
            return tuple(sig(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, sig(v)) for k, v in a.items())
        if not _plain(a):
            raise _Unprobeable
        return ("C", repr(a))

    try:
        parts = sig((node.args, node.kwargs))
    except _Unprobeable:
        return None  # an argument the probe cannot rebuild (a tensor without a value, an object)
    target = type(graph.model.get_submodule(node.target)).__qualname__ if node.op == "call_module" else _target_id(node)
    return (node.op, target, parts, tp)


class _Unprobeable(Exception):
    pass


def _target_id(node: torch.fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, slice, torch.dtype, torch.device, type(Ellipsis)))


def _has_state(graph: OpGraph, target: str) -> bool:
    mod = graph.model.get_submodule(target)
    return any(True for _ in mod.parameters()) or any(True for _ in mod.buffers())


def _probe_all(op: Op, graph: OpGraph, tp: int) -> list[tuple[tuple[str, ...], str]]:
    choices = [_candidates(graph.values[v].shape, tp) for v in op.inputs]
    combos = [c for c in itertools.product(*choices) if any(p != "R" for p in c)][:_MAX_COMBOS]
    found = []
    with quiet_probes():  # once for all the combinations: entering it costs more than a probe
        for combo in combos:
            out = _probe(op, graph, tp, dict(zip(op.inputs, combo)))
            if out is not None:
                found.append((combo, out))
    return found


def _candidates(shape: tuple[int, ...], tp: int) -> list[str]:
    return ["R"] + [f"S{d}" for d, n in enumerate(shape) if n % tp == 0 and n >= tp]


def _probe(op: Op, graph: OpGraph, tp: int, placement: dict[int, str]) -> str | None:
    """The output placement when DTensor runs ``op`` shard-locally and the local run agrees."""
    from torch.distributed.tensor.debug import CommDebugMode

    try:
        with torch.no_grad(), CommDebugMode() as comm:
            result = _call(op, graph, _args(op, placement, tp, distributed=True))
        if comm.get_total_counts():
            return None
        out = _result_placement(result)
        if out is None:
            return None
        with torch.no_grad():
            local = _call(op, graph, _args(op, placement, tp, distributed=False))
    except Exception:  # noqa: BLE001 - DTensor refusing (or needing a collective) is the answer "no"
        return None
    return out if _local_shapes(result) == _shapes(local) else None


def _broadcasts_into(target: Any, index: Any, value: Any) -> bool:
    """``target[index] = value`` is a valid write: the value broadcasts to the indexed
    region's shape. Meta's ``index_put_`` does not check it (a rank's ``[2, 1, 16, 12]``
    region took a whole ``[2, 2, 16, 12]`` value there, and failed on the ranks)."""
    if not isinstance(value, torch.Tensor):
        return True
    region = target[index].shape
    try:
        return torch.broadcast_shapes(value.shape, region) == region
    except RuntimeError:
        return False


def _mesh(tp: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if tp not in _meshes:
        _meshes[tp] = DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)
    return _meshes[tp]


def _tensor(val: torch.Tensor, p: str, tp: int, *, distributed: bool) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = list(val.shape)
    if p.startswith("S"):
        shape[int(p[1:])] //= tp
    local = torch.empty(shape, dtype=val.dtype, device="meta")
    if not distributed:
        return local
    where = Shard(int(p[1:])) if p.startswith("S") else Replicate()
    return DTensor.from_local(local, _mesh(tp), (where,), run_check=False, shape=val.shape, stride=val.stride())


def _args(op: Op, placement: dict[int, str], tp: int, *, distributed: bool) -> tuple[tuple, dict]:
    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            i, val = a.meta.get("shardplan_op"), a.meta.get("val")
            if i in placement:
                return _map_tensors(val, lambda t: _tensor(t, placement[i], tp, distributed=distributed))
            return val
        if isinstance(a, (tuple, list)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    return arg(op.node.args), arg(op.node.kwargs)


def _map_tensors(val: Any, fn) -> Any:
    if isinstance(val, torch.Tensor):
        return fn(val)
    if isinstance(val, (tuple, list)):
        return type(val)(_map_tensors(v, fn) for v in val) if not hasattr(val, "_fields") else type(val)(*(_map_tensors(v, fn) for v in val))
    return val


def _call(op: Op, graph: OpGraph, call: tuple[tuple, dict]) -> Any:
    args, kwargs = call
    node = op.node
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return graph.model.get_submodule(node.target)(*args, **kwargs)


def _result_placement(result: Any) -> str | None:
    """One placement for every tensor of the result (a tuple's elements agree), else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    leaves = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    if not leaves or not all(isinstance(t, DTensor) for t in leaves):
        return None
    found = set()
    for t in leaves:
        (p,) = t.placements
        if type(p) is Shard:
            found.add(f"S{p.dim}")
        elif isinstance(p, Replicate):
            found.add("R")
        else:
            return None  # Partial (and _StridedShard): the hand rules own those
    return found.pop() if len(found) == 1 else None


def _local_shapes(result: Any) -> list[tuple[int, ...]]:
    return [tuple(t._local_tensor.shape) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]


def _shapes(result: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
