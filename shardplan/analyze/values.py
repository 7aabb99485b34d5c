"""Example values: what the tracer computes on CPU where model code reads a tensor's values.

Contract
--------
The meta tracer (:mod:`.trace`) runs every op on meta tensors, which have shapes and no
values. Where code needs a value (``if not padding_mask.any():``, ``n = mask.sum().item()``,
``int(i)``, an f-string naming a module) or an op has no meta kernel, :class:`ExampleValues`
computes the traced node from the example inputs the caller passed, on CPU, each node once:
the branch the examples take is traced, and the tracer's notes name the source line. Only
values that depend on real inputs and on non-meta tensors can be computed; one that depends
on meta weights raises :class:`NotConcrete`, except ``nonzero`` (``torch.where(cond)``,
``argwhere``), which is taken at its upper bound, every element nonzero: torch's own meta
kernel does the same under ``meta_nonzero_assume_all_nonzero``
(:func:`nonzero_at_upper_bound`), and ``bincount(indices, minlength=E)`` of such a value,
every bin counting every element. Nothing here depends on the machine beyond the inputs'
values: no random numbers are drawn, and float results only decide branches.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch import nn

__all__ = ["UPPER_BOUND_NOTE", "ExampleValues", "NotConcrete", "bounded", "holds_tensor", "nonzero_at_upper_bound",
           "op_name"]

UPPER_BOUND_NOTE = ("sizes that depend on tensor values (the rows `nonzero`, `torch.where` or a boolean index select, "
                    "as MoE dispatch does) are taken at their upper bound, every row selected: the estimate's "
                    "communication and compute for them are upper bounds")


class NotConcrete(Exception):
    """A traced value cannot be computed from the example inputs; the message says why."""


class ExampleValues:
    """Node -> its value on the example inputs, computed on demand (see the module doc).

    ``run_module(module, args, kwargs)`` runs a module's forward on real tensors without the
    tracer recording it; ``attribute(target)`` reads a ``get_attr`` target; ``where(node)``
    names the node's module and source line for notes."""

    def __init__(self, root: nn.Module, *, run_module: Callable[..., Any], attribute: Callable[[str], Any],
                 where: Callable[[torch.fx.Node], str], notes: list[str], assumed: list[str]) -> None:
        self.root, self._run_module, self._attribute, self._where = root, run_module, attribute, where
        self.notes, self.assumed = notes, assumed
        self.inputs: dict[str, Any] = {}  # placeholder name -> the real example value given for it
        self.values: dict[torch.fx.Node, Any] = {}
        self.bounded: set[torch.fx.Node] = set()  # taken at an upper bound, or computed from one

    def concrete(self, node: torch.fx.Node) -> Any:
        if node not in self.values:
            with torch.device("cpu"):  # a model built and planned under ``torch.device("meta")``
                self.values[node] = self._evaluate(node)
            if any(n in self.bounded for n in node.all_input_nodes):
                self.bounded.add(node)
        return self.values[node]

    def _evaluate(self, node: torch.fx.Node) -> Any:
        known = node.meta.get("val")
        if "val" in node.meta and not holds_tensor(known):
            # sizes, dtypes and flags hold for any values; values are computed on CPU
            return torch.device("cpu") if isinstance(known, torch.device) else known
        if node.op == "placeholder":
            if node.target in self.inputs:
                return self.inputs[node.target]
            raise NotConcrete(f"input {node.target!r} was given on the meta device; pass real example inputs")
        if node.op == "get_attr":
            return _real(self._attribute(str(node.target)), _user_name(node.target))
        if node.op == "call_module":  # its weights first: real inputs would not help meta weights
            mod = self.root.get_submodule(str(node.target))
            for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
                _real(t, f"{_user_name(node.target)}.{name}")
        try:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.concrete)
        except NotConcrete:
            if _counts_bins(node):
                return self._all_counted(node)
            if not _finds_nonzero(node):
                raise
            return self._all_nonzero(node)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return self._run_module(self.root.get_submodule(str(node.target)), args, kwargs)
        raise NotConcrete(f"{node.op} {node.target} has no value")

    def _all_counted(self, node: torch.fx.Node) -> Any:
        """``bincount(indices, minlength=E)`` of a router's choice that depends on meta weights
        (DeepSeek-V3's ``counts = torch.bincount(indices.flatten(), minlength=E).tolist()``, then
        ``if counts[i] == 0: continue``): at the same upper bound as ``nonzero``, every expert
        receives every one of the ``indices``, so every expert's code is traced."""
        self._assume(node)
        self.bounded.add(node)
        self.notes.append(f"{op_name(node)} {self._where(node)}: each of the {_minlength(node)} counts taken as every "
                          "element of its input (its input depends on weights): the upper bound, every expert "
                          "receives every token")
        return torch.full((_minlength(node),), node.args[0].meta["val"].numel(), dtype=torch.long)

    def _assume(self, node: torch.fx.Node) -> None:
        stack = node.meta.get("nn_module_stack") or {}
        module = _user_name(next(reversed(stack.values()))[0]) if stack else ""
        if module and module != "m" and module not in self.assumed:
            self.assumed.append(module)  # its code needs values meta tensors lack: the local check runs around it

    def _all_nonzero(self, node: torch.fx.Node) -> Any:
        """``nonzero`` of a value that depends on meta weights (which experts a router picked)
        at its upper bound: the rows are then every index, in order, so a loop over them
        (``for expert_idx in expert_hit``) visits every expert once."""
        self._assume(node)
        self.bounded.add(node)
        self.notes.append(f"{op_name(node)} {self._where(node)}: every element taken as nonzero (its input depends "
                          "on weights): the upper bound, every expert receives every token")
        rows = torch.ones(node.args[0].meta["val"].shape, dtype=torch.bool).nonzero()
        if op_name(node) == "where" or node.kwargs.get("as_tuple") or node.args[1:2] == (True,):
            return tuple(rows.unbind(1))  # torch.where(cond) and nonzero(as_tuple=True): one index tensor per dim
        return rows


def bounded(target: Any, args: tuple, meta_of: Callable[[Any], Any]) -> bool:
    """Whether an op's output size depends on values, so that torch's meta kernels (under
    :func:`nonzero_at_upper_bound`) give its upper bound. ``meta_of``: an argument's meta."""
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name in ("nonzero", "argwhere", "masked_select") or (name == "where" and len(args) == 1):
        return True
    if target is operator.getitem and len(args) > 1:  # x[mask]: a boolean index selects rows
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(m := meta_of(i), torch.Tensor) and m.dtype == torch.bool for i in index)
    return False


@contextlib.contextmanager
def nonzero_at_upper_bound() -> Iterator[None]:
    """torch's meta ``nonzero`` (and what calls it: ``torch.where(cond)``, boolean indexing)
    returns every element, the upper bound, instead of raising."""
    from torch.fx.experimental import _config

    saved = _config.meta_nonzero_assume_all_nonzero
    _config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        _config.meta_nonzero_assume_all_nonzero = saved


@contextlib.contextmanager
def scalars_on_meta_as_zero(*, truth: bool = False) -> Iterator[None]:
    """``.item()`` of a meta tensor returns 0 (``truth`` for a bool) instead of raising: code
    that reads a value only to decide a warning (Hugging Face's ``pad_token_id in input_ids``)
    or to assert (``truth=True``: torchtune's ``assert (self.cache_pos[0] + s) <= max_seq``)
    runs on meta, so the shapes around it can be checked. Sizes computed from such values are
    not to be trusted; the checks that use it warn only when even this run fails."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Zero(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and args and getattr(args[0], "is_meta", False):
                return truth if args[0].dtype == torch.bool else 0
            return func(*args, **(kwargs or {}))

    with _Zero():
        yield


def op_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _minlength(node: torch.fx.Node) -> Any:
    return node.kwargs.get("minlength", node.args[2] if len(node.args) > 2 else None)


def _counts_bins(node: torch.fx.Node) -> bool:
    """``bincount`` with a fixed number of bins (``minlength``, the experts) and no weights."""
    minlength = _minlength(node)
    return (op_name(node) == "bincount" and isinstance(minlength, int) and minlength > 0
            and node.kwargs.get("weights") is None and len(node.args) < 2)


def _finds_nonzero(node: torch.fx.Node) -> bool:
    name = op_name(node)
    return name in ("nonzero", "argwhere") or (name == "where" and len(node.args) == 1 and not node.kwargs)


def _real(value: Any, name: str) -> Any:
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise NotConcrete(f"{name} is on the meta device (the value depends on weights or buffers; build the "
                          "model on CPU to trace it)")
    return value


def _user_name(target: Any) -> str:
    return str(target).removeprefix("m.")  # the tracer's root wraps the model as ``m``


def holds_tensor(value: Any, *, meta: bool = False) -> bool:
    """Whether ``value`` (a tensor, or a structure of them) holds a tensor; ``meta``: one on
    the meta device."""
    return torch.utils._pytree.tree_any(lambda v: isinstance(v, torch.Tensor) and (v.is_meta or not meta), value)
