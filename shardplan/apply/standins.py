"""Stand-ins: the local check of the code around the blocks, each block replaced by its plan.

Contract
--------
``check_outer_code(graph, plan, placements, mesh=None)``, once the blocks passed
:func:`~.localcheck.check_local_shapes`, runs the model's own forward, on meta
tensors and sharded by ``plan``, with every block the local check runs on its own (and
every folded copy of one) replaced by a stand-in. A stand-in compares each tensor it is
handed with the local shape the plan expects there (the traced call's shape, 1/tp on a
split dim) and returns the block's outputs as the plan hands them on. A mismatch is a
:class:`~.localcheck.LocalShapeError` naming the block and the argument (``module`` None:
no module of the model is at fault, the code between them is). So is any other failure of
that code, unless the same run with nothing split fails too (code meta cannot run: then it
is not the plan's to judge, and the ranks run it as before).

Why it is needed: the blocks are checked one by one, on the inputs the trace recorded, so
code outside them never ran sharded. Hugging Face's decoders compute positions from the
embedding's output (``arange(inputs_embeds.shape[1])``); with that output on sequence shards
each rank makes the positions of 1/tp of the sequence, and the first attention fails on the
ranks (RoPE tables of s/tp rows beside s), not in planning. Stand-ins keep the run as cheap
as the model without its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only

from ..analyze.graph import OpGraph
from ..analyze.snapshot import preserved
from ..decide.placements import local_shape
from ..decide.propagation import quiet_probes
from ..analyze.values import nonzero_at_upper_bound, scalars_on_meta_as_zero
from ..plan.model import Plan, expand_pattern
from .emit import shard
from .localcheck import (
    LocalShapeError, _at_or_under, cut_on_entry, region_value, _check_mesh, _culprit, _local_args, _meta_copy, _said, _targets, _track_modules,
    _user_frame, renamed_plan,
)

__all__ = ["check_outer_code", "OuterCodeError", "stood_blocks"]


class OuterCodeError(LocalShapeError):
    """The code between the blocks fails on the plan's shards, or hands a block a tensor of
    another local shape than the plan's (it read a size off a split tensor)."""


class _StandIn(nn.Module):
    """A block's place in the model: checks what it is handed, returns what it would. It
    carries the block's plain attributes (``config``, ``layer_idx``, ``attention_type``), which
    the code between the blocks may read (Granite's sliding-window layers pick their RoPE
    tables by the layer's type); reading them failed, and that code went unchecked."""

    def __init__(self, fqn: str, expected: tuple[tuple, dict], outputs: Any, attributes: dict[str, Any]) -> None:
        super().__init__()
        self.__dict__.update(attributes)
        self._fqn, self._expected, self._outputs = fqn, expected, outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        want_args, want_kwargs = self._expected
        handed = [(f"argument {i}", a, w) for i, (a, w) in enumerate(zip(args, want_args))]
        handed += [(k, v, want_kwargs[k]) for k, v in kwargs.items() if k in want_kwargs]
        for name, got, want in handed:
            _compare(self._fqn, name, got, want)
        return tree_map_only(tuple, _empty, self._outputs, is_leaf=_is_spec)


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The attributes of ``module`` that are neither submodules, tensors nor nn.Module's own."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and not isinstance(v, (nn.Module, torch.Tensor))}


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype)


def _empty(spec: tuple) -> torch.Tensor:
    return torch.empty(spec[0], dtype=spec[1], device="meta") if _is_spec(spec) else spec


def _compare(fqn: str, name: str, got: Any, want: Any) -> None:
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    if got_spec != want_spec:
        return
    for g, w in zip(got_leaves, want_leaves):
        g = g.to_local() if isinstance(g, DTensor) else g  # a handover: the block's entry makes it local
        if isinstance(g, torch.Tensor) and isinstance(w, _Shape) and tuple(g.shape) != w.dims:
            raise OuterCodeError(
                f"{fqn}: the code around it hands it {name} of local shape {list(g.shape)} where the plan expects "
                f"{list(w.dims)}: that code reads a size off a split tensor (positions or a mask made from a "
                "sequence-split embedding output cover 1/tp of the sequence)", None)


@dataclass(frozen=True)
class _Shape:
    """A planned local shape, a leaf to pytree (a plain tuple would be flattened)."""

    dims: tuple[int, ...]


def _shapes(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: _Shape(tuple(t.shape)), value)


def _stand_in(graph: OpGraph, fqn: str, placements: dict[int, str], tp: int, plan: Plan | None) -> _StandIn:
    call = graph.traced.calls[graph.traced.folded.get(fqn, fqn)][0]
    # a folded copy is handed what its representative's entry cut leaves: the stream the
    # first block receives whole and cuts reaches every later block as the shard
    cut = cut_on_entry(graph, plan, fqn) if fqn in graph.traced.folded else {}
    expected = _shapes(_local_args(call, {**placements, **_gathered_around(graph, fqn, plan), **cut}, tp))

    def spec(node: Any) -> Any:
        value = graph.values[node.meta["shardplan_op"]]
        return (local_shape(value.shape, placements.get(value.id, "R"), tp), value.dtype)

    if call.items:
        outputs: Any = tuple(spec(call.items[i]) if i in call.items else None for i in range(max(call.items) + 1))
    else:
        outputs = spec(call.outputs[0]) if call.outputs else None
    return _StandIn(fqn, expected, outputs, _plain_attributes(graph.model.get_submodule(fqn)))


def _gathered_around(graph: OpGraph, fqn: str, plan: Plan | None) -> dict[int, str]:
    """Values a region of a module enclosing ``fqn`` gathers where that module receives them
    (a MoE block's tokens, ``Shard(1) -> Replicate``): a block inside it (its router) is handed
    them whole."""
    found: dict[int, str] = {}
    for r in plan.regions if plan is not None else ():
        if r.input == "output" or r.desired_input_layouts != "Replicate" or not (r.input_layouts or "").startswith("Shard"):
            continue
        for module in expand_pattern(r.module, plan.model.repeats):
            calls = graph.traced.calls.get(graph.traced.folded.get(module, module))
            if not calls or not fqn.startswith(module + "."):  # a stand-in's own regions are not applied
                continue
            value = region_value(calls[0], r.input)
            if value is not None:
                found[value] = "R"
    return found


def _outside(plan: Plan, blocks: list[str]) -> Plan:
    """The plan's entries for modules in no stood-in block, as plain names."""
    return renamed_plan(plan, lambda pattern: [f for f in expand_pattern(pattern, plan.model.repeats)
                                               if not _at_or_under(f, blocks)])


def _with_stand_ins(model: nn.Module, stand_ins: dict[str, _StandIn]) -> nn.Module:
    """A meta copy of ``model`` with the stand-ins in place; ``model`` itself is left as it was."""
    with preserved(model):
        for fqn, stand_in in stand_ins.items():
            parent, _, name = fqn.rpartition(".")
            (model.get_submodule(parent) if parent else model)._modules[name] = stand_in
        return _meta_copy(model)


def _outermost(fqns: set[str]) -> list[str]:
    return sorted(f for f in fqns if not any(f.startswith(o + ".") for o in fqns))


def stood_blocks(graph: OpGraph) -> list[str]:
    """The blocks the check stands in for (folded copies included); empty when the whole
    model is one block. A stack the forward never calls (Phi-4-multimodal's audio encoder
    on text inputs) is not stood in for: it does not run, and leaving it out must not leave
    the code between the called blocks unchecked."""
    blocks = [t for t in _targets(graph) if t]
    called = {f for f in set(graph.traced.folded) | set(blocks) if graph.traced.folded.get(f, f) in graph.traced.calls}
    return _outermost(called) if blocks and "" in graph.traced.calls else []


def check_outer_code(graph: OpGraph, plan: Plan, placements: dict[int, str], *, mesh: Any = None) -> str | None:
    """Run after :func:`~.localcheck.check_local_shapes` passed, on the same mesh. Returns a
    note when that code could not be run on meta at all (it was not checked)."""
    stood = stood_blocks(graph)
    if plan.tp == 1 or not stood:
        return None  # nothing split, or the whole model is one block: its run covered this code
    with _check_mesh(plan, mesh) as tp_mesh:
        if tp_mesh is not None:
            return _check_on(graph, stood, plan, placements, tp_mesh)
    return None


def _check_on(graph: OpGraph, stood: list[str], plan: Plan, placements: dict[int, str], mesh: Any) -> str | None:
    try:
        _run(graph, stood, plan, placements, mesh)
        return None
    except LocalShapeError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged by the same run unsharded
        if _runs_unsharded(graph, stood):
            # in a module of its own (not the root's code): its local sizes are looked for, or it runs whole
            raise OuterCodeError(
                f"{type(graph.model).__name__}: the code between its blocks fails on its shards at "
                f"{_user_frame(exc)}: {_said(exc)}", getattr(exc, "shardplan_module", None)) from None
        first = exc
    # it fails on meta even unsharded: a value read only to decide a warning (``pad_token_id
    # in input_ids``) is the usual cause; read as 0, the shapes around it can still be checked
    try:
        with scalars_on_meta_as_zero():
            if not _runs_unsharded(graph, stood):
                raise first
            _run(graph, stood, plan, placements, mesh)
        return None
    except LocalShapeError:
        raise
    except Exception:  # noqa: BLE001 - said in the plan's warnings
        if "_StandIn" in str(first):  # the code reads a block's attributes: checked with the blocks themselves
            return None
        return (f"{type(graph.model).__name__}: the code between its blocks was not checked on local shapes: it fails "
                f"on the meta device even unsharded, at {_user_frame(first)}: {_said(first)}")


def _run(graph: OpGraph, stood: list[str], plan: Plan | None, placements: dict[int, str], mesh: Any) -> None:
    """The model with its blocks stood in for, sharded by ``plan`` (None: unsharded), once."""
    tp = plan.tp if plan is not None else 1
    model = _with_stand_ins(graph.model, {f: _stand_in(graph, f, placements, tp, plan) for f in stood})
    if plan is not None:
        shard(model, mesh, _outside(plan, stood))
    args, kwargs = _local_args(graph.traced.calls[""][0], placements, tp)
    running = _track_modules(model)
    try:
        with torch.no_grad(), quiet_probes(), nonzero_at_upper_bound():
            out = model(*args, **kwargs)
    except Exception as exc:
        # the module between the blocks whose code failed (an attention pool after them)
        exc.shardplan_module = _culprit(model, running, "")
        raise
    if plan is not None:
        _compare_outputs(graph, out, placements, tp)


def _compare_outputs(graph: OpGraph, out: Any, placements: dict[int, str], tp: int) -> None:
    """The model's outputs have the local shapes the plan gives them: code after the blocks
    that views a sequence-split tensor by a global size (GPT-2's ``view(-1, *input_shape[1:],
    hidden)``) regroups the rows silently, with no error to catch."""
    node = next(n for n in graph.traced.graph.nodes if n.op == "output")
    traced = [n for n in tree_flatten(node.args[0])[0] if isinstance(n, torch.fx.Node) and "shardplan_op" in n.meta]
    got = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if len(traced) != len(got):
        return
    for n, g in zip(traced, got):
        value = graph.values.get(n.meta["shardplan_op"])
        g = g.to_local() if isinstance(g, DTensor) else g
        want = local_shape(value.shape, placements.get(value.id, "R"), tp) if value is not None else None
        if want is not None and tuple(g.shape) != tuple(want):
            raise OuterCodeError(
                f"{type(graph.model).__name__}: the code around its blocks returns a tensor of local shape "
                f"{list(g.shape)} where the plan expects {list(want)}: that code reads a size off a split tensor", None)


def _runs_unsharded(graph: OpGraph, stood: list[str]) -> bool:
    """Whether the code between the blocks runs on meta with nothing split (else meta, not
    the plan, is what it cannot take)."""
    try:
        _run(graph, stood, None, {}, None)
    except Exception:  # noqa: BLE001 - any failure: the code cannot run on meta here
        return False
    return True
