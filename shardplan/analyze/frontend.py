"""Front ends: a model and its example inputs -> the op graph, by the meta fx tracer or torch.export.

Contract
--------
``op_graph(model, example_inputs, example_kwargs, *, front_end="auto", fold=True)`` returns
the :class:`~shardplan.analyze.graph.OpGraph` the planner solves. ``"fx"``: the meta fx
tracer (:mod:`.trace`, the fast path); ``"export"``: torch.export (:mod:`.export`); both
fold repeated blocks unless ``fold`` is False. ``"auto"``: the tracer, then torch.export
wherever the tracer or the graph built from it fails, and a
:class:`~shardplan.analyze.trace.TraceError` carrying both reasons when both fail;
torch.export starts from the model as it was before the tracer ran (:mod:`.snapshot`).
Hugging Face models are traced with ``config.use_cache = False`` (planning traces training).
The result depends on the model and inputs only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .graph import OpGraph, build_graph
from .snapshot import snapshot
from .trace import TraceError, trace_model

__all__ = ["FRONT_ENDS", "op_graph"]

FRONT_ENDS = ("auto", "fx", "export")


@contextlib.contextmanager
def _training_trace(model: nn.Module) -> Iterator[None]:
    config = getattr(model, "config", None)
    saved = getattr(config, "use_cache", None)
    if saved:
        config.use_cache = False
    # torch.distributions checks its arguments' values (logits finite, probs in [0, 1]):
    # a bool of a meta or traced tensor, which stops the trace (BLT's entropy patcher)
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
        if saved:
            config.use_cache = saved


def op_graph(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, *, front_end: str = "auto",
             fold: bool = True, tracer: Callable[..., Any] = trace_model) -> OpGraph:
    """The op graph of ``model``; see the module docstring. ``tracer``: the fx front end."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end={front_end!r}; expected one of {FRONT_ENDS} ('auto': the meta fx tracer, "
                         "then torch.export where it fails)")
    # what a trace leaves on the model (CTRL's ``self.pos_encoding = self.pos_encoding.to(...)``
    # assigns a proxy to a buffer) would answer every later forward in place of the real
    # value: the second front end's, and the planner's own runs of the model's code (the
    # outer-code check), where calling a dead tracer's proxy crashed the process
    before = snapshot(model)
    try:
        if front_end == "export":
            return _exported(model, example_inputs, example_kwargs, None, fold)
        try:
            with _training_trace(model):
                return build_graph(tracer(model, example_inputs, example_kwargs=example_kwargs, fold_repeated=fold))
        except Exception as fx_exc:  # noqa: BLE001 - any failure of the fast path: try the second front end
            if front_end == "fx":
                raise
            before.restore()
            return _exported(model, example_inputs, example_kwargs, fx_exc, fold)
    finally:
        before.restore()


def _exported(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
              fx_exc: Exception | None, fold: bool = True) -> OpGraph:
    from .export import export_trace

    try:
        with _training_trace(model):
            return build_graph(export_trace(model, example_inputs, example_kwargs, fold_repeated=fold))
    except TraceError as exc:
        if fx_exc is None:
            raise
        raise TraceError(_both_failed(str(fx_exc), str(exc))) from fx_exc


def _both_failed(fx: str, export: str) -> str:
    """Both front ends' reasons; one short line when both stopped at the same error (a shape
    bug in the user's model: the fx tracer says where, export only what)."""
    core = export.split(": ", 1)[1].rstrip(".") if ": " in export else ""
    if core and core in fx:
        where = fx.split(core)[0].rstrip(": ")
        return (f"{where}: {core}. Both front ends stop there: the model's forward fails on these example inputs "
                "before any sharding; check its shapes and example_inputs")
    return f"{fx} (the fx tracer); {export} (the second front end)"
