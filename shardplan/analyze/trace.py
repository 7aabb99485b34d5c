"""Tracing: any ``nn.Module`` plus example inputs -> an fx graph with meta shapes.

Contract
--------
``trace_model(model, example_inputs)`` returns a :class:`Traced`: a ``torch.fx.Graph``
whose every tensor-valued node carries ``node.meta["val"]``, a meta tensor with the
node's global shape and dtype. Modules that own parameters directly (Linear, Embedding,
norms, ...) are leaves: one ``call_module`` node each. Everything else is traced through,
so the graph shows the ops between weights. Parameters may live on the meta device or on
CPU; nothing is allocated beyond meta tensors, except the values :mod:`.values` computes.

Shapes resolve to Python ints during tracing (the tracer runs meta tensors alongside the
proxies), so control flow on shapes works. Control flow on *values* (a mask built from the
ids, a count read with ``.item()``, experts picked by ``nonzero``) follows the example
inputs' values where they are real tensors (:mod:`.values`), with a note naming the line;
a value that depends on meta weights raises :class:`TraceError` naming the module.

Repeated blocks: children of a ``ModuleList``/``ModuleDict``/``Sequential`` with the same
structure (class, parameter names, shapes and dtypes) are *folded*: the first is traced
through, the others become single ``call_module`` nodes whose output shape is copied from
the first. The optimizer solves the representative once, so planning time does not grow
with depth beyond this cheap walk.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import linecache
import operator
import os
import sys
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.fx.experimental.meta_tracer import MetaDeviceAttribute, MetaProxy, MetaTracer

from .snapshot import snapshot
from .values import (UPPER_BOUND_NOTE, ExampleValues, NotConcrete, bounded, holds_tensor, nonzero_at_upper_bound,
                     op_name)

__all__ = ["TraceError", "ModuleCall", "Traced", "trace_model", "module_signature", "owns_params"]


class TraceError(ValueError):
    """The model could not be traced; the message names the module and what to try."""


@dataclass
class ModuleCall:
    """One call of a (possibly non-leaf) module: which graph values went in and out."""

    fqn: str
    args: list[torch.fx.Node | None]
    kwargs: dict[str, torch.fx.Node]
    outputs: list[torch.fx.Node]
    # the call's arguments with tensors as meta tensors, to re-run the module alone
    example: tuple[tuple, dict] = ((), {})
    # a tuple or list output: index -> the node there (``out[i]`` of a folded copy is this)
    items: dict[int, torch.fx.Node] = field(default_factory=dict)
    num_items: int = 0  # that output's length, non-tensor elements (a None state) counted


@dataclass
class Traced:
    graph: torch.fx.Graph
    model: nn.Module
    calls: dict[str, list[ModuleCall]] = field(default_factory=dict)
    # folded instance FQN -> FQN of the representative that was traced through
    folded: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # assumptions the tracer had to make
    # modules the local check cannot run on meta tensors: their output shape was assumed, or
    # their code reads values (a loop over the experts ``nonzero`` found)
    assumed: list[str] = field(default_factory=list)
    front_end: str = "fx"  # "export": shardplan.analyze.export built it (folded the same way)

    def module(self, fqn: str) -> nn.Module:
        return self.model.get_submodule(fqn)


def _rebind_in_place(kind: str, target: Any, args: tuple, rv: torch.fx.Proxy, meta: Any) -> None:
    """``out.add_(y)`` returns ``out`` changed: the code reads the result through the proxy it
    already holds, so that proxy now stands for the op's node (SSA, as torch.export's
    functionalization gives). Otherwise every later reader read the value from before the
    write: Llama 4's ``out = shared_expert(x); out.add_(routed)`` returned the shared
    expert's output alone, and the plan placed the block's return on that."""
    if (kind == "call_method" and isinstance(target, str) and target.endswith("_") and not target.startswith("__")
            and args and isinstance(args[0], torch.fx.Proxy) and isinstance(meta, torch.Tensor)):
        args[0].node = rv.node


def owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def is_weight_leaf(module: nn.Module) -> bool:
    """Owns parameters and no descendant does: one op in the graph (Linear, norm, experts).
    A container that also owns a parameter (BERT's prediction head bias) is traced through,
    unless its own are raw weights beside norm children (:func:`_raw_weights_with_norms`).
    torch's ``nn.MultiheadAttention`` is one op too: its call reads its child ``out_proj``'s
    parameters itself (``F.multi_head_attention_forward``), never calling it."""
    if isinstance(module, nn.MultiheadAttention) or listed_heads(module) is not None:
        return True
    return owns_params(module) and (
        not any(owns_params(m) for _, m in module.named_modules() if m is not module) or _raw_weights_with_norms(module)
        or bank_with_router(module) is not None)


def bank_with_router(module: nn.Module) -> list[str] | None:
    """The router's parameter names when ``module`` owns a bank of experts as raw 3-D
    weights (:func:`~.graph.expert_params`) and its only weighted child is the Linear that
    scores its E experts (a user's MoE: ``self.router = nn.Linear(h, E)`` beside
    ``self.w_up = nn.Parameter(torch.empty(E, h, f))``): one op, as an expert bank is, its
    router run whole inside it. None otherwise. (Which 3-D weight is which is
    :func:`~.graph.expert_params`'s to read; here, two or three of E experts each.)"""
    weighted = [(n, m) for n, m in module.named_modules() if m is not module and owns_params(m)]
    if len(weighted) != 1 or not isinstance(weighted[0][1], nn.Linear):
        return None
    name, router = weighted[0]
    banks = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if len(banks) not in (2, 3) or any(p.shape[0] != router.out_features for p in banks):
        return None
    return [f"{name}.{p}" for p, _ in router.named_parameters()]


def _raw_weights_with_norms(module: nn.Module) -> bool:
    """Owns two or more weights of 2+ dims itself, and its descendants own only 1-D
    parameters (an attention on raw ``self.wq ... self.wo`` with ``q_norm``/``k_norm``
    modules): one op too, its code run whole on DTensors (``dtensor_weights``), its norms
    with it."""
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    return len(own) >= 2 and all(p.dim() <= 1 for n, p in module.named_parameters() if "." in n)


def listed_heads(module: nn.Module) -> tuple[str, str] | None:
    """``(list, proj)``: the children of a module written as a list of alike heads and one
    projection of their outputs side by side (Karpathy's ``MultiHeadAttention``:
    ``proj(cat([h(x) for h in self.heads], -1))``), else None. Such a module is one op
    too (``listed_heads``: the list split whole over tp). Recognized by structure alone: it
    owns no parameter itself; its children that hold parameters are one ``nn.ModuleList`` of
    two or more alike modules, each made of two or more Linears ``[w, d]`` (query, key,
    value), and one Linear ``[d, n w]``. :mod:`shardplan.decide.listed` checks the calls."""
    if owns_params(module):
        return None
    weighted = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    lists = [(n, c) for n, c in weighted if isinstance(c, nn.ModuleList)]
    projs = [(n, c) for n, c in weighted if type(c) is nn.Linear]
    if len(lists) != 1 or len(projs) != 1 or len(weighted) != 2 or len(lists[0][1]) < 2:
        return None
    (name, heads), (proj_name, proj) = lists[0], projs[0]
    n = len(heads)
    inner = [m for m in heads[0].modules() if owns_params(m)]
    if len(inner) < 2 or any(type(m) is not nn.Linear for m in inner) or proj.in_features % n:
        return None
    if {(m.in_features, m.out_features) for m in inner} != {(proj.out_features, proj.in_features // n)}:
        return None
    first = module_signature(heads[0])
    return (name, proj_name) if all(module_signature(h) == first for h in heads) else None


def module_signature(module: nn.Module) -> str:
    """A hash of class, parameter/buffer names, shapes and dtypes: equal hash, same structure."""
    h = hashlib.sha256(type(module).__qualname__.encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    for name, sub in module.named_modules():
        h.update(f"{name}:{type(sub).__qualname__};".encode())
    return h.hexdigest()


def _repeated_groups(model: nn.Module) -> dict[str, str]:
    """Map each repeated container child (after the first of its kind) to the first."""
    folded: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        first_of: dict[str, str] = {}
        for name, child in mod.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            sig = module_signature(child)
            if sig in first_of and not owns_params(child):
                folded[child_fqn] = first_of[sig]
            else:
                first_of.setdefault(sig, child_fqn)
    # a container inside a folded block never runs: its own repeats are not representatives
    return {k: v for k, v in folded.items() if not _under_any(k, folded) and not _under_any(v, folded)}


def _under_any(fqn: str, prefixes: dict[str, str]) -> bool:
    parts = fqn.split(".")
    return any(".".join(parts[:k]) in prefixes for k in range(1, len(parts)))


def _flat_nodes(value: Any) -> list[torch.fx.Node]:
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_aggregate(
        value, lambda v: nodes.append(v.node) if isinstance(v, torch.fx.Proxy) else None
    )
    return nodes


class _ShardTracer(MetaTracer):
    """torch's MetaTracer, made strict and taught module boundaries and folding."""

    def __init__(self, model: nn.Module, folded: dict[str, str], state_ids: frozenset[int] = frozenset()) -> None:
        super().__init__()
        # fx's own stack recording formats every frame of every op and imports
        # torch.export (a third of a second); _frames keeps (file, line) pairs instead
        self.record_stack_traces = False
        self.model = model
        self.folded = folded
        self.calls: dict[str, list[ModuleCall]] = {}
        self._fold_cache: dict[str, tuple[tuple, Any]] = {}
        self._computing_meta = False
        self.notes: list[str] = []
        self.assumed: list[str] = []
        self._constants: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []
        # id of a model tensor the forward wrote into (a KV cache) -> the proxy later reads get
        self._written: dict[int, torch.fx.Proxy] = {}
        # ids of the tensors a first trace saw written: read as proxies from their first read, so
        # a reference the code keeps (``k_out = self.k_cache; ...; return k_out``) is traced too
        self.state_ids = state_ids
        self._view_writes: set[int] = set()  # ids of model tensors written through a view of them
        self._module_paths = {id(m): n for n, m in model.named_modules()}
        # node -> its value on the example inputs, where code reads one (see .values)
        self.examples = ExampleValues(model, run_module=partial(self._module_meta, real=True),
                                      attribute=self._attribute, where=_where, notes=self.notes,
                                      assumed=self.assumed)

    def _fqn(self, m: nn.Module) -> str:
        return self._module_paths.get(id(m), "")

    def create_arg(self, a: Any) -> Any:
        """Constant tensors (a rope table passed to every block) are looked up once: fx
        would scan every buffer of the model per use, quadratic in depth."""
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
            name = self._constants.get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
            node = super().create_arg(a)
            if isinstance(node, torch.fx.Node) and node.op == "get_attr":
                self._constants[id(a)] = node.target
                self._keep.append(a)  # ids stay unique while the tensor lives
                # its value now: forward code may rebind the attribute (``self.cache_k =
                # self.cache_k.to(xq)``), so it is not looked up again after tracing
                node.meta.setdefault("val", _to_meta(a))
            return node
        try:
            return super().create_arg(a)
        except NotImplementedError:
            # an object fx cannot spell in code (a cache dict, a class): the graph is only
            # analysed, never turned back into code, so keep the object itself
            return a

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if isinstance(attr_val, torch.Tensor) and not getattr(self, "_disable_module_getattr", False):
            state = self._written.get(id(attr_val))
            if state is None and id(attr_val) in self.state_ids:
                state = self._state_proxy(attr_val)
            if state is not None:
                return state
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _write_into_state(self, kind: str, target: Any, args: tuple) -> tuple[str, Any, tuple] | None:
        """``self.cache_k[:b, p:p + s] = xk`` or ``self.k_cache.index_copy_(2, pos, k)``: the
        forward writes a traced value into a model's own tensor (a buffer). Read eagerly, that
        tensor would be a constant to every later reader, and the keys read back from the cache
        would not depend on the keys written: the write becomes an in-place op on the buffer's
        ``get_attr`` value, and later reads of the buffer read that value."""
        if not args or isinstance(args[0], torch.fx.Proxy) or not isinstance(args[0], torch.Tensor):
            return None
        setitem = (kind == "call_method" and target == "__setitem__") or (
            kind == "call_function" and target in (operator.setitem, torch.Tensor.__setitem__))
        in_place = kind == "call_method" and isinstance(target, str) and target.endswith("_") and not target.startswith("__")
        if not (setitem or in_place) or isinstance(args[0], nn.Parameter):
            return None
        state = self._state_proxy(args[0])
        if state is None:
            # a view of a model tensor written (litgpt's ``self.k[:n].index_copy_(...)``): the next
            # trace reads the tensor itself as a proxy, and the view of it is traced
            base = args[0]._base
            if base is not None and self._model_tensor(base):
                self._view_writes.add(id(base))
            return None
        if setitem:
            return "call_function", operator.setitem, (state, *args[1:])
        return kind, target, (state, *args[1:])

    def _model_tensor(self, tensor: torch.Tensor) -> bool:
        """A buffer or plain tensor attribute of the model (what ``create_arg`` names by its path)."""
        return self.tensor_attrs.get(tensor) is not None or any(tensor is b for b in self.root.buffers())

    def _state_proxy(self, tensor: torch.Tensor) -> torch.fx.Proxy | None:
        """The proxy that stands for a model tensor forward writes into, from now on."""
        node = self.create_arg(tensor)
        if not isinstance(node, torch.fx.Node) or node.op != "get_attr" or str(node.target).startswith("_tensor_constant"):
            return None
        state = self.proxy(node)
        node.meta["val"] = _to_meta(tensor)
        state.install_tensor_meta(node.meta["val"])
        self._written[id(tensor)] = state
        return state

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) not in self._module_paths:
            # made inside forward (litgpt's ``nn.Identity()`` per call): not the model's, so
            # no rule can name it; its code is traced instead (an Identity leaves no op)
            return False
        fqn = self._fqn(m)
        if fqn in self.folded or is_weight_leaf(m):
            return True
        # parameter-free torch.nn modules (activations, dropout) are leaves too; torch.nn's
        # containers of weight modules (nn.TransformerEncoder, nn.Transformer) are traced through
        return super().is_leaf_module(m, module_qualified_name) and not any(True for _ in m.parameters())

    def call_module(self, m, forward, args, kwargs):
        if self._computing_meta:  # inside a leaf's meta forward: plain meta tensors, no graph
            return forward(*args, **kwargs)
        fqn = self._fqn(m)
        self._promote_if_first(fqn)
        out = super().call_module(m, forward, args, kwargs)
        self._record_call(fqn, args, kwargs, out)
        if fqn and fqn not in self.folded and fqn in self.folded.values():
            self._fold_cache[fqn] = (self._meta_key(args, kwargs), out)
        return out

    def _promote_if_first(self, fqn: str) -> None:
        """The first copy of a folded group to run is traced through: code that skips idle
        experts (``if not counts[i]: continue``) may never call the first by name."""
        rep = self.folded.get(fqn)
        if rep is None or rep in self.calls:
            return
        for copy, its_rep in list(self.folded.items()):
            if its_rep == rep:
                self.folded[copy] = fqn
        self.folded[rep] = fqn
        del self.folded[fqn]

    def _record_call(self, fqn: str, args, kwargs, out) -> None:
        arg_nodes = [a.node if isinstance(a, torch.fx.Proxy) else None for a in args]
        kw_nodes = {k: v.node for k, v in kwargs.items() if isinstance(v, torch.fx.Proxy)}
        example = torch.fx.node.map_aggregate((tuple(args), dict(kwargs)), _proxy_meta_or_value)
        items = {i: v.node for i, v in enumerate(out) if isinstance(v, torch.fx.Proxy)} if isinstance(out, (tuple, list)) else {}
        self.calls.setdefault(fqn, []).append(ModuleCall(fqn, arg_nodes, kw_nodes, _flat_nodes(out), example, items,
                                                         len(out) if isinstance(out, (tuple, list)) else 0))

    @staticmethod
    def _meta_key(args, kwargs) -> tuple:
        metas = torch.fx.node.map_aggregate((args, kwargs), _proxy_meta_or_value)
        return _shape_key(metas)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        frames = _frames(sys._getframe(1))
        written = self._write_into_state(kind, target, args) if kind in ("call_method", "call_function") else None
        if written is not None:
            kind, target, args = written
        if kind == "call_module" and target in self.folded:
            rv = self._folded_proxy(kind, target, args, kwargs, name, type_expr)
            rv.node.meta["shardplan_frames"] = frames
            return rv
        rv = torch.fx.Tracer.create_proxy(self, kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        rv.node.meta["shardplan_frames"] = frames
        if not torch.is_grad_enabled():
            rv.node.meta["shardplan_no_grad"] = True
        if kind == "placeholder":
            if target in self.meta_args:
                rv.install_tensor_meta(self.meta_args[target])
                rv.node.meta["val"] = self.meta_args[target]
            return rv
        if kind == "output":
            return rv
        try:
            meta = self._compute_meta(kind, target, args, kwargs)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - computed from the example values, else re-raised
            meta = self._meta_from_values(rv.node, exc)
        if bounded(target, args, _proxy_meta_or_value) and UPPER_BOUND_NOTE not in self.notes:
            self.notes.append(UPPER_BOUND_NOTE)
        rv.install_tensor_meta(meta)
        rv.node.meta["val"] = meta
        _rebind_in_place(kind, target, args, rv, meta)  # ``buf.index_copy_(...)``: the buffer's proxy too
        return rv

    def _compute_meta(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op on meta tensors: every real tensor (CPU weights, sliced buffers) goes meta."""
        if target in self.orig_fns and "device" in kwargs:
            kwargs = {**kwargs, "device": "meta"}
        args_m = torch.fx.node.map_aggregate(args, _meta_of)
        kwargs_m = torch.fx.node.map_aggregate(kwargs, _meta_of)
        if kind == "call_function":
            return target(*args_m, **kwargs_m)
        if kind == "call_method":
            return getattr(args_m[0], target)(*args_m[1:], **kwargs_m)
        if kind == "call_module":
            return self._leaf_meta(str(target), args_m, kwargs_m)
        if kind == "get_attr":
            return _to_meta(self._attribute(str(target)))
        return None

    def _meta_from_values(self, node: torch.fx.Node, exc: Exception) -> Any:
        """An op the meta device cannot run (``.item()``, ``nonzero``, a boolean-mask index):
        its shape depends on values, so it is computed from the example inputs' values, and
        the graph holds the shape those values give."""
        try:
            value = self.examples.concrete(node)
        except NotConcrete as why:
            raise TraceError(f"{_meta_failure_message(node.op, node.target, node, exc)} ({why})") from exc
        if node not in self.examples.bounded:  # an upper bound's own note says what it is
            self.notes.append(f"{op_name(node)} {_where(node)}: computed from the example inputs' values "
                              "(its result depends on them); the plan holds for inputs like them")
        return _to_meta(value)

    def _attribute(self, target: str) -> Any:
        """The real attribute behind a ``get_attr``, not the tracer's proxy of it."""
        self._disable_module_getattr = True
        try:
            value = self.root
            for atom in target.split("."):
                value = getattr(value, atom)
        finally:
            self._disable_module_getattr = False
        return value

    def _leaf_meta(self, target: str, args: tuple, kwargs: dict) -> Any:
        """A weight module's output shape. Experts that route tokens by value (MoE) cannot run
        on meta tensors; such a module maps hidden states to hidden states, so its output is
        taken to be shaped like its first input, and the plan says so."""
        mod = self.root.get_submodule(target)
        try:
            return self._module_meta(mod, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - decided below, re-raised if not an experts-like leaf
            # the rows: torchtitan's bank takes its counts [E] first, the rows [N, H] second
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if first is None or not is_weight_leaf(mod) or all(p.dim() < 3 for p in mod.parameters(recurse=False)):
                raise
            self.assumed.append(target.removeprefix("m."))
            self.notes.append(
                f"{target.removeprefix('m.')}: output shape taken from its input "
                f"({type(exc).__name__} on the meta device: data-dependent routing)"
            )
            return torch.empty_like(first)

    def _module_meta(self, mod: nn.Module, args: tuple, kwargs: dict, *, real: bool = False) -> Any:
        state = {n: t if real else _to_meta(t) for n, t in list(mod.named_parameters()) + list(mod.named_buffers())}
        self._disable_module_getattr = True
        self._computing_meta = True
        try:
            # forward, not __call__: the tracer has patched __call__ to record module calls
            with _reparametrize_module(mod, state):
                return mod.forward(*args, **kwargs)
        finally:
            self._disable_module_getattr = False
            self._computing_meta = False

    def _folded_proxy(self, kind, target, args, kwargs, name, type_expr):
        """A folded block: reuse the representative's output meta when inputs match."""
        rv = torch.fx.Tracer.create_proxy(self, kind, target, args, kwargs, name, type_expr)
        rep = self.folded[target]
        key, rep_out = self._fold_cache.get(rep, (None, None))
        if key == self._meta_key(args, kwargs):
            meta = torch.fx.node.map_aggregate(rep_out, _proxy_meta_or_value)
        else:
            args_m = torch.fx.node.map_aggregate(args, _meta_of)
            kwargs_m = torch.fx.node.map_aggregate(kwargs, _meta_of)
            meta = self._module_meta(self.root.get_submodule(target), args_m, kwargs_m)
        rv.install_tensor_meta(meta)
        rv.node.meta["val"] = meta
        return rv

    def proxy(self, node: torch.fx.Node) -> MetaProxy:
        return _IterableMetaProxy(node, self)


_STRUCTURAL = frozenset({"is_nested", "is_sparse", "is_quantized", "is_mkldnn", "ndim", "dtype", "layout"})


class _IterableMetaProxy(MetaProxy):
    """Tuple outputs (``q, k = x.chunk(2)``, blocks returning tuples) unpack by their meta."""

    def size(self, dim: int | None = None) -> Any:
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, torch.Tensor):  # torch's MetaProxy tests `if dim`: size(0) gave the shape
            return meta.size() if dim is None else meta.size(dim)
        return super().size(dim)

    def __iter__(self):
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, (tuple, list)):
            return iter([self[i] for i in range(len(meta))])
        if isinstance(meta, torch.Tensor) and meta.dim() > 0:  # iterating a tensor walks dim 0
            return iter([self[i] for i in range(meta.shape[0])])
        return super().__iter__()

    def __getattr__(self, name: str) -> Any:
        # a tensor's structural facts are the meta tensor's: ``if src.is_nested`` (torch's
        # nn.TransformerEncoder) branches on them, and no shard changes them
        meta = self.__dict__.get("_tensor_meta")
        if name in _STRUCTURAL and isinstance(meta, torch.Tensor):
            return getattr(meta, name)
        return super().__getattr__(name)

    def __setitem__(self, key: Any, value: Any) -> None:
        # ``t[..., i] = v``: record it; the solver keeps operands of ops without outputs whole
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __len__(self) -> int:
        meta = getattr(self, "_tensor_meta", None)
        if meta is None:
            raise TraceError("len() of a traced value without a known shape")
        return len(meta)

    def _number(self) -> Any:
        """The traced 0-d value as a Python number; :class:`NotConcrete` if it has none."""
        value = self.tracer.examples.concrete(self.node)
        return value.item() if isinstance(value, torch.Tensor) else value

    def _python_value(self, why: str) -> Any:
        """:meth:`_number`, where the code cannot go on without it (an index, ``int()``)."""
        try:
            return self._number()
        except NotConcrete as exc:
            raise TraceError(f"{why} of traced value {self.node.name} {_where(self.node)}: {exc}") from None

    def __index__(self) -> int:
        return operator.index(self._python_value("an index"))

    def __int__(self) -> int:
        return int(self._python_value("int()"))

    def __format__(self, spec: str) -> str:
        # ``self[f"expert_{expert_idx[0]}"]``: the module the example values name
        # (a value with none computable, a log line's loss, keeps fx's own text)
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, torch.Tensor) and meta.dim() == 0:
            try:
                return format(self._number(), spec)
            except NotConcrete:
                return super().__format__(spec)
        return super().__format__(spec)

    def __bool__(self) -> bool:
        meta = getattr(self, "_tensor_meta", None)
        if not isinstance(meta, torch.Tensor):
            return bool(meta)
        # ``if not padding_mask.any():``: the branch the example inputs' values take is traced
        try:
            taken = bool(self.tracer.examples.concrete(self.node))
        except NotConcrete as why:
            line = _user_line(self.node)
            raise TraceError(
                f"control flow depends on tensor values at {self.node.name}{f' ({line})' if line else ''} "
                f"(data-dependent branch); tracing on the meta device cannot follow it: {why}"
            ) from None
        self.tracer.notes.append(f"branch {_where(self.node)} traced as the example inputs take it ({taken})")
        return taken


def _proxy_meta_or_value(v: Any) -> Any:
    if isinstance(v, torch.fx.Proxy):
        return getattr(v, "_tensor_meta", None)
    return v


def _shape_key(metas: Any) -> tuple:
    out: list = []
    torch.fx.node.map_aggregate(
        metas,
        lambda v: out.append((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)),
    )
    return tuple(out)


def _meta_of(v: Any) -> Any:
    if isinstance(v, MetaDeviceAttribute):
        return torch.device("meta")
    if isinstance(v, torch.fx.Proxy):
        meta = getattr(v, "_tensor_meta", None)
        if meta is None:  # an attribute read (``x.ndim``) carries its value on its node
            meta = v.node.meta.get("val")
        if meta is None:
            raise TraceError(f"no shape is known for {v.node.name}; the tracer lost track of it")
        return meta
    if isinstance(v, torch.Tensor) and not v.is_meta and v.dim() > 0:
        # a 0-d CPU tensor is a value (``torch.div(n, 2, rounding_mode="trunc")`` as a view's
        # size) and mixes with tensors on any device; larger ones go meta
        return _to_meta(v)
    return v


def _meta_failure_message(kind: str, target: Any, node: torch.fx.Node, exc: Exception) -> str:
    where = _where(node)
    fqn = str(target)[2:] if kind == "call_module" and str(target).startswith("m.") else getattr(target, "__name__", target)
    return (
        f"could not compute the shape of {kind} {fqn!s} {where}: {type(exc).__name__}: {str(exc)[:200]}; "
        "the op may depend on tensor values (e.g. MoE routing) or be unsupported on the meta device. "
        "check that example_inputs match forward() (a sequence longer than the model's position table: a smaller "
        "seq_len, --seq), or plan a model whose forward depends only on shapes."
    )


def _where(node: torch.fx.Node) -> str:
    """The module and the user's source line an op came from."""
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else "m"
    module = "<top level>" if module == "m" else module.removeprefix("m.")
    return f"in module {module!r}" + (f" at {_user_line(node)}" if _user_line(node) else "")


def _frames(frame: Any) -> tuple[tuple[str, int], ...]:
    """(file, line) of each frame from ``frame`` out to the outermost ``forward`` (the model's
    entry; frames beyond it are the caller's script), innermost first."""
    found, last_forward = [], 0
    while frame is not None:
        found.append((frame.f_code.co_filename, frame.f_lineno))
        if frame.f_code.co_name == "forward":
            last_forward = len(found)
        frame = frame.f_back
    return tuple(found[:last_forward])


def _user_line(node: torch.fx.Node) -> str:
    frames = node.meta.get("shardplan_frames")
    if frames is not None:
        for path, line in frames:
            if not (path == "<shardplan-root>" or _machinery(path)):
                return f"{portable_path(path)}:{line} `{linecache.getline(path, line).strip()}`"
        return ""
    lines = (node.stack_trace or "").splitlines()  # a torch.export node
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if not text.startswith("File ") or "<shardplan-root>" in text:
            continue
        path = text.split(",")[0][5:].strip(chr(34))
        if _machinery(path):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        return f"{portable_path(path)}:{text.split('line ')[1].split(',')[0]} `{code}`"
    return ""


# shardplan's own code, by the installed package's directory rather than by a folder name
# (a clone of the repository is itself a folder named "shardplan"); its built-in models
# are model code like any user's
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODELS_DIR = os.path.join(_PACKAGE_DIR, "models")


def is_internal(path: str) -> bool:
    """Whether a source file is shardplan's own machinery (not its built-in models)."""
    full = os.path.abspath(path)
    return full.startswith(_PACKAGE_DIR + os.sep) and not full.startswith(_MODELS_DIR + os.sep)


def _machinery(path: str) -> bool:
    """torch's, shardplan's own (not its built-in models) or the import system's source."""
    return "/torch/" in path or is_internal(path) or path.startswith("<frozen ") or path.endswith("/importlib/__init__.py")


def user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of traceback ``tb`` that runs the user's code, if any."""
    return next((f for f in reversed(traceback.extract_tb(tb)) if not _machinery(f.filename)), None)


def portable_path(path: str) -> str:
    """A source path that reads the same on every machine (plan files are compared byte for
    byte): installed packages from ``site-packages/``, shardplan's own files from the
    directory holding the package, others relative to the working directory when under it."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    for root in (os.path.dirname(_PACKAGE_DIR), os.getcwd()):
        if os.path.abspath(path).startswith(root + os.sep):
            return os.path.relpath(path, root)
    return path


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_like(value, device="meta")
    return value


def _root_wrapper(model: nn.Module, inputs: tuple, kwargs: dict[str, Any]) -> nn.Module:
    """A module whose forward has explicit parameters: fx cannot read ``*args`` signatures
    (transformers 5 wraps ``forward`` in decorators that hide the real one).

    Only inputs holding a tensor become parameters (``x{i}`` or the keyword's name); the rest
    (a ``None`` that fills a positional slot, a flag) are passed as the constants they are,
    since a placeholder has no value: ``if attention_mask is None`` would see a proxy."""
    consts: list[Any] = []

    def arg(name: str, value: Any) -> tuple[list[str], str]:
        if holds_tensor(value):
            return [name], name
        consts.append(value)
        return [], f"self.shardplan_consts[{len(consts) - 1}]"

    pos = [arg(f"x{i}", v) for i, v in enumerate(inputs)]
    kw = [(k, arg(k, kwargs[k])) for k in sorted(kwargs)]
    params = [n for names, _ in pos for n in names] + [n for _, (names, _) in kw for n in names]
    call = ", ".join([expr for _, expr in pos] + [f"{k}={expr}" for k, (_, expr) in kw])
    src = f"def forward(self, {', '.join(params)}):\n    return self.m({call})\n"
    scope: dict[str, Any] = {}
    exec(compile(src, "<shardplan-root>", "exec"), scope)
    wrapper_cls = type("ShardplanRoot", (nn.Module,), {"forward": scope["forward"]})
    root = wrapper_cls()
    root.m = model
    root.shardplan_consts = consts
    return root


def trace_model(
    model: nn.Module,
    example_inputs: tuple,
    *,
    example_kwargs: dict[str, Any] | None = None,
    fold_repeated: bool = True,
) -> Traced:
    """Trace ``model`` on meta tensors shaped like ``example_inputs``; see the module doc."""
    kwargs = dict(example_kwargs or {})
    root = _root_wrapper(model, tuple(example_inputs), kwargs)
    folded = {f"m.{k}": f"m.{v}" for k, v in _repeated_groups(model).items()} if fold_repeated else {}
    meta_args = {f"x{i}": _to_meta(a) for i, a in enumerate(example_inputs) if holds_tensor(a)}
    meta_args.update({k: _to_meta(v) for k, v in kwargs.items() if holds_tensor(v)})
    named = {**{f"x{i}": a for i, a in enumerate(example_inputs)}, **kwargs}
    state_ids: frozenset[int] = frozenset()
    before = snapshot(model)
    while True:  # twice where forward writes into the model's tensors (a KV cache)
        tracer = _ShardTracer(root, dict(folded), state_ids)
        tracer.examples.inputs = {k: v for k, v in named.items() if k in meta_args and not holds_tensor(v, meta=True)}
        graph = _trace(tracer, root, meta_args, model)
        written = set(tracer._written) | tracer._view_writes
        if state_ids or not written - state_ids:
            break
        state_ids = frozenset(written)
        before.restore()
    return _strip_root(graph, model, tracer)


def _trace(tracer: _ShardTracer, root: nn.Module, meta_args: dict[str, Any], model: nn.Module) -> torch.fx.Graph:
    _cache_device_constructors()
    try:
        # grad on while tracing, whatever the caller's mode: a node made with it off ran under
        # the model's own ``torch.no_grad()`` (HRM's recurrent steps but the last), and no
        # gradient flows through it
        with _mask_checks_take_proxies(), nonzero_at_upper_bound(), torch.enable_grad():
            return tracer.trace(root, meta_args)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the module that failed
        raise TraceError(
            f"tracing {type(model).__name__} failed: {type(exc).__name__}: {exc}. "
            "Check that example_inputs match forward(), or make the failing module a leaf."
        ) from exc


def _cache_device_constructors() -> None:
    """``with torch.device(d)`` moves the calls of the functions in a set torch builds once per
    process. fx's meta tracer swaps ``torch.arange``, ``torch.ones``... for wrappers while it
    traces; were that set first built then (code under trace that enters a device context),
    it would hold the wrappers for good, and every later ``torch.arange`` under
    ``torch.device("meta")`` would make a CPU tensor: the user's next model built on meta
    gets CPU buffers. Built here, before any swap."""
    from torch.utils import _device

    constructors = getattr(_device, "_device_constructors", None)
    if constructors is not None:
        constructors()


@contextlib.contextmanager
def _mask_checks_take_proxies() -> Iterator[None]:
    """torch's attention modules check a mask's type (``F._none_or_dtype``: None or a Tensor,
    else raise) before canonicalizing it; a traced mask is a proxy whose meta is the tensor."""
    import torch.nn.functional as F

    original = F._none_or_dtype

    def none_or_dtype(value: Any) -> Any:
        meta = getattr(value, "_tensor_meta", None) if isinstance(value, torch.fx.Proxy) else None
        return meta.dtype if isinstance(meta, torch.Tensor) else original(value)

    F._none_or_dtype = none_or_dtype
    try:
        yield
    finally:
        F._none_or_dtype = original


def _strip_root(graph: torch.fx.Graph, model: nn.Module, tracer: _ShardTracer) -> Traced:
    """Drop the wrapper's ``m.`` prefix so FQNs are the user's."""
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            node.target = node.target[2:] if node.target.startswith("m.") else node.target
            if node.op == "call_module" and node.target == "m":
                node.target = ""  # the model is itself a weight module (a bare nn.Linear)

    def user_fqn(fqn: str) -> str:
        return "" if fqn == "m" else fqn[2:]

    calls = {
        user_fqn(k): [ModuleCall(user_fqn(c.fqn), c.args, c.kwargs, c.outputs, c.example, c.items, c.num_items) for c in v]
        for k, v in tracer.calls.items()
        if k == "m" or k.startswith("m.")
    }
    # a copy whose children were traced one by one is no folded copy: a container that is never
    # called (lucidrains' ``for norm, attn, norm2, ff in self.layers`` over ModuleLists) has
    # each child traced on its own, and folding it too gave them two rules. A copy never
    # called at all (an expert the example leaves idle) stays folded: planned as its neighbours
    called = {node.target for node in graph.nodes if node.op == "call_module"}
    folded = {k[2:]: v[2:] for k, v in tracer.folded.items()
              if k[2:] in called or not any(c.startswith(k[2:] + ".") for c in called)}
    for node in graph.nodes:  # tensors fx captured as constants (sliced buffers, rope tables)
        if node.op == "get_attr" and "val" not in node.meta:
            node.meta["val"] = _to_meta(tracer._attribute(node.target if node.target.startswith("_tensor_constant")
                                                          else f"m.{node.target}" if node.target else "m"))
    return Traced(graph=graph, model=model, calls=calls, folded=folded, notes=list(tracer.notes),
                  assumed=list(tracer.assumed))


def signature_params(model: nn.Module) -> list[str]:
    """Positional parameter names of ``model.forward`` (for error messages)."""
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []
