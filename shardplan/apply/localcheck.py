"""Local check: run a plan's shards on meta tensors before anyone runs them on GPUs.

Contract
--------
``check_local_shapes(graph, plan)`` applies ``plan`` to a meta-device copy of each
representative block (the whole model when nothing repeats) under a temporary fake process
group of the plan's tp size (or, under the caller's process group, on the caller's mesh:
meta tensors communicate nothing), and runs it once on the example shapes the tracer recorded.
Model code that hard-codes a global size (``view(b, s, self.num_heads, d)`` where the
local tensor holds ``num_heads / tp`` heads) fails here, and the check raises
:class:`~shardplan.decide.solve.PlanningError` naming the module and the source line, instead of
handing the user a plan that crashes on the cluster. The plan is therefore the same with or
without a process group.

A weight module whose own code cannot run on meta even unsharded (an expert bank splitting
its rows by ``counts.tolist()``) is stood in for (:func:`stand_in_for`: a meta tensor of its
output's planned local shape), and the block runs again, so the code around it is checked;
only code of the block's own that fails so skips the check, with a warning.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections import Counter
from typing import Any, Callable, Collection, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ..analyze.graph import OpGraph
from ..analyze.trace import portable_path, user_frame
from ..analyze.values import nonzero_at_upper_bound, scalars_on_meta_as_zero
from ..plan.model import Plan, expand_pattern
from ..decide.heads import BROADCASTS
from ..decide.placements import groups_of, local_shape, shard_dim
from ..decide.propagation import quiet_probes
from ..decide.solve import PlanningError
from .collectives import record_collectives
from .emit import shard
from .mesh import fake_process_group, make_mesh

__all__ = ["check_local_shapes", "LocalShapeError", "LocalCheckUnavailable"]


class LocalShapeError(PlanningError):
    """A block's shards fail to run; ``module`` is the innermost module that was running."""

    def __init__(self, message: str, module: str | None, leaf: str | None = None, *, collectives: bool = False) -> None:
        super().__init__(message)
        self.module = module
        # the weight module whose own forward was running (a Linear subclass that topk's and
        # scatter_'s its output, Llama 4's router): splitting it is what fails
        self.leaf = leaf
        # it ran, but its code made other collectives than its style was priced at
        self.collectives = collectives


def _targets(graph: OpGraph) -> list[str]:
    """The modules the check runs: each kind of repeated block (or the whole model), and
    where one holds a module whose output shape the tracer assumed (experts routing on meta
    tensors), the parts of it that do not (the attention beside the experts)."""
    cached = graph.strategy_cache.get("check_targets")
    if cached is None:
        reps = sorted(r for r in set(graph.traced.folded.values()) if r in graph.traced.calls)  # ran in forward
        blocks = reps + _unfolded_siblings(graph, reps)
        blocks += _layers_outside(graph, blocks)
        blocks += _modules_outside(graph, blocks) if blocks else []
        cached = graph.strategy_cache["check_targets"] = [t for b in blocks or [""] for t in _around_assumed(graph, b)]
    return cached


def _modules_outside(graph: OpGraph, blocks: list[str]) -> list[str]:
    """The outermost modules with weights whose own code views or reshapes (a Perceiver's
    cross-attentions, called by the model's forward beside a ``Sequential`` head) and that no
    block holds, nor hold one: each is checked on its own, as a block is. Unchecked, a view
    by a global head count (``q.reshape(b, n, self.heads, -1)``) ran on shards, the ``-1``
    absorbing the split; the code between modules is the outer check's."""
    from ..analyze.trace import is_weight_leaf

    viewing = {op.owner for op in graph.ops if op.kind == "function" and op.target in _SIZED_OPS}
    out: list[str] = []
    for fqn in sorted(graph.traced.calls, key=lambda f: (f.count("."), f)):
        if not fqn or fqn in graph.traced.folded or _at_or_under(fqn, [*blocks, *out]) \
                or any(b.startswith(fqn + ".") for b in blocks) or not any(_at_or_under(o, [fqn]) for o in viewing):
            continue
        mod = graph.model.get_submodule(fqn)
        if not is_weight_leaf(mod) and any(True for _ in mod.parameters()):
            out.append(fqn)
    return out


def _layers_outside(graph: OpGraph, blocks: list[str]) -> list[str]:
    """The layers (children of a ``ModuleList``, ...) whose modules run in none of ``blocks``
    nor in a folded copy: where folds are only inside layers (the experts of a stack too short
    to fold), each such layer is checked on its own, outermost first. The embedding and the
    head beside a stack are in no container and need no block."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    listed = {f"{fqn}.{name}" if fqn else name for fqn, m in graph.model.named_modules() if isinstance(m, containers)
              for name, _ in m.named_children()}
    out: set[str] = set()
    for fqn in graph.traced.calls:
        parts = fqn.split(".")
        layer = next((".".join(parts[:k]) for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in listed), None)
        if layer is not None and layer in graph.traced.calls and not _at_or_under(fqn, graph.traced.folded) \
                and not _at_or_under(fqn, blocks):
            out.add(layer)
    return sorted(out)


def _at_or_under(fqn: str, modules: Collection[str]) -> bool:
    """Whether ``fqn`` is one of ``modules`` or inside one."""
    parts = fqn.split(".")
    return any(".".join(parts[:k]) in modules for k in range(1, len(parts) + 1))


def _unfolded_siblings(graph: OpGraph, reps: list[str]) -> list[str]:
    """The blocks beside the folded ones that are of a kind of their own (T5's first block,
    which alone computes the position bias): they run once and no representative covers
    them."""
    folded = set(graph.traced.folded) | set(graph.traced.folded.values())
    out: set[str] = set()
    for container in {r.rpartition(".")[0] for r in reps if "." in r}:
        for name, _ in graph.model.get_submodule(container).named_children():
            fqn = f"{container}.{name}"
            if fqn not in folded and fqn in graph.traced.calls:
                out.add(fqn)
    return sorted(out)


def _around_assumed(graph: OpGraph, fqn: str) -> list[str]:
    """``fqn`` itself, its modules whose output shape the tracer assumed stood in for (shaped
    as the trace recorded them), so its own code (the attention beside the experts, written
    in the block) is checked; else, where one cannot be stood in for, its children."""
    inside = [a for a in graph.traced.assumed if not fqn or a == fqn or a.startswith(fqn + ".")]
    if not inside:
        return [fqn] if fqn in graph.traced.calls else []
    if fqn in inside:
        return []
    if fqn in graph.traced.calls and all(_output_value(graph, a) is not None for a in inside):
        graph.strategy_cache.setdefault("check stands in", set()).update(inside)
        return [fqn]
    module = graph.model.get_submodule(fqn) if fqn else graph.model
    return [t for name, _ in module.named_children() for t in _around_assumed(graph, f"{fqn}.{name}" if fqn else name)]


def _sub_plan(plan: Plan, prefix: str) -> Plan:
    """The plan's rules and regions for the modules under ``prefix``, made relative to it."""
    def rel(pattern: str) -> list[str]:
        if not prefix:
            return [pattern]
        fqns = expand_pattern(pattern, plan.model.repeats)
        return sorted({f[len(prefix) + 1:] for f in fqns if f.startswith(prefix + ".")} | ({""} if prefix in fqns else set()))

    return renamed_plan(plan, rel)


def renamed_plan(plan: Plan, names: Callable[[str], list[str]]) -> Plan:
    """``plan`` with each rule, region, attribute set, buffer entry and view fix written once per name
    ``names(its module pattern)`` gives (none: left out), its folds expanded."""
    update = {key: [e.model_copy(update={"module": m}) for e in getattr(plan, key) for m in names(e.module)]
              for key in ("rules", "regions", "attributes", "buffers", "local_views")}
    return plan.model_copy(update={**update, "model": plan.model.model_copy(update={"repeats": {}})})


def _meta_copy(module: nn.Module) -> nn.Module:
    memo = _state_memo(module)
    clone = copy.deepcopy(module, memo)
    _rebind_closures(clone, memo)
    return clone if all(p.is_meta for p in clone.parameters()) else clone.to("meta")


def _rebind_closures(clone: nn.Module, memo: dict[int, Any]) -> None:
    """A function kept as a module attribute that closes over the module's own children
    (minGPT: ``self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))``) is copied as the
    same function, still calling the original's modules; the copy's gets cells holding the
    copied modules instead, so the check runs the copy's code on the copy."""
    for mod in clone.modules():
        for name, fn in list(vars(mod).items()):
            cells = getattr(fn, "__closure__", None) if isinstance(fn, types.FunctionType) else None
            held = [_cell(c) for c in cells or ()]
            if any(id(h) in memo for h in held):
                new = tuple(types.CellType(memo.get(id(h), h)) for h in held)
                setattr(mod, name, types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, new))


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _state_memo(module: nn.Module) -> dict[int, Any]:
    """A deepcopy memo that hands over, detached, the tensors a forward left on its modules as
    plain attributes (RecurrentGemma's ``self.recurrent_states``) or wrote into its buffers
    with autograd on (a KV cache, ``self.cache_k[:b, pos:pos + s] = k``): a tensor autograd
    made refuses to be deep-copied, and no later forward reads its history."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for value in [*vars(m).values(), *m._buffers.values()]:
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.grad_fn is not None:
                memo[id(value)] = value.detach()
    return memo


def _user_frame(exc: BaseException) -> str:
    frame = user_frame(exc.__traceback__)
    return f"{portable_path(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else "an unknown line"


class ExitPlacements(dict):
    """Placements (value -> placement) and the conversions made where a module returns a
    value (``exits``: value -> (that module, the placement its readers get): a whole value
    cut, a partial sum reduce-scattered). A block outside that module is handed the
    converted value; code inside it still makes the value as it was."""

    def __init__(self, placements: dict[int, str], exits: dict[int, tuple[str, str]]) -> None:
        super().__init__(placements)
        self.exits = exits

    def handed(self, value: int | None, target: str) -> str:
        """The placement of ``value`` as the block ``target`` is handed it."""
        module, p = self.exits.get(value, (None, None))
        if module is not None and not _at_or_under(module, [target]):
            return p
        return self.get(value, "R")


def cut_on_entry(graph: OpGraph, plan: Any, fqn: str) -> dict[int, str]:
    """Values the plan cuts onto shards where block ``fqn`` (or its representative) receives
    them whole, value -> ``S{d}``: a region ``Replicate -> Shard(d)`` on its input, as the
    first block cuts the stream the model's top-level code hands it (``tok(idx) + pe[:, :T]``)."""
    rep = graph.traced.folded.get(fqn, fqn)
    calls = graph.traced.calls.get(rep) or []
    found: dict[int, str] = {}
    for r in plan.regions if plan is not None and calls else ():
        want = r.desired_input_layouts or ""
        if r.module not in (fqn, rep) or r.input == "output" or r.input_layouts != "Replicate" or not want.startswith("Shard("):
            continue
        value = region_value(calls[0], r.input)
        if value is not None:
            found[value] = f"S{want[len('Shard('):-1]}"
    return found


def region_value(call: Any, key: int | str) -> int | None:
    """The value a region's ``input`` (a position or keyword) names in a recorded call."""
    node = call.args[key] if isinstance(key, int) and key < len(call.args) else call.kwargs.get(key)
    return getattr(node, "meta", {}).get("shardplan_op") if node is not None else None


def handed_placement(placements: dict[int, str], value: int | None, target: str | None) -> str:
    """The placement of ``value`` as the block ``target`` is handed it (:class:`ExitPlacements`;
    with plain placements, or no target, as placed)."""
    if isinstance(placements, ExitPlacements) and target is not None:
        return placements.handed(value, target)
    return placements.get(value, "R")


def _local_args(call, placements: dict[int, str], tp: int, target: str | None = None) -> tuple[tuple, dict]:
    """The call's example arguments as one rank holds them (a Shard(d) input is 1/tp on d);
    with ``target``, as that block is handed them (:class:`ExitPlacements`)."""
    def local(node, value):
        if not isinstance(value, torch.Tensor) or isinstance(node, (list, tuple)):
            # on meta as the copy's weights are: a model built on a real device hands its
            # blocks real buffers (a RoPE table), which a meta block cannot mix with
            return tree_map_only(torch.Tensor, _on_meta, value)
        p = handed_placement(placements, getattr(node, "meta", {}).get("shardplan_op"), target)
        if shard_dim(p) is None:
            return _on_meta(value)
        return torch.empty(_local_shape(value.shape, p, tp), dtype=value.dtype, device="meta")

    args, kwargs = call.example
    return (
        tuple(local(n, v) for n, v in zip(call.args, args)),
        {k: local(call.kwargs.get(k), v) for k, v in kwargs.items()},
    )


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device="meta")


def _track_modules(block: nn.Module, *, prepend: bool = False) -> list[str]:
    """A live stack of the submodules running inside ``block`` (names relative to it); with
    ``prepend``, a module counts as running from before its style's own pre-hooks."""
    stack: list[str] = []
    for name, sub in block.named_modules():
        sub.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n), prepend=prepend)
        sub.register_forward_hook(lambda _m, _a, _o: stack.pop() and None)  # None keeps the output
    return stack


def _culprit(block: nn.Module, stack: list[str], target: str) -> str | None:
    """The innermost running module that holds weights below it, as an absolute FQN."""
    from ..analyze.trace import is_weight_leaf

    for name in reversed(stack):
        sub = block.get_submodule(name)
        if name and not is_weight_leaf(sub) and any(True for _ in sub.parameters()):
            return f"{target}.{name}" if target else name
    return target or None  # the whole model: no submodule to run whole


def _failing_leaf(block: nn.Module, stack: list[str], target: str) -> str | None:
    """The weight module itself, when the failure is inside its own forward."""
    from ..analyze.trace import is_weight_leaf

    # a stock module (nn.Linear) that fails was handed a wrong-sized input: its caller's doing
    if stack and is_weight_leaf(leaf := block.get_submodule(stack[-1])) and \
            not type(leaf).forward.__module__.startswith("torch.nn."):
        return ".".join(n for n in (target, stack[-1]) if n)
    return None


def check_local_shapes(graph: OpGraph, plan: Plan, placements: dict[int, str], *, mesh: Any = None) -> None:
    """Run each block's shards on meta tensors; raise :class:`LocalShapeError` where they fail.

    Without a process group it makes a fake one of the plan's tp size. Under the caller's
    process group (``auto_parallelize`` under torchrun) it runs on ``mesh``'s tp axis
    instead: DTensor on meta tensors computes shapes only and communicates nothing, so the
    check, and the plan, are the same with or without a process group."""
    if plan.tp == 1:
        return  # nothing split
    with _check_mesh(plan, mesh) as tp_mesh:
        if tp_mesh is None:
            raise LocalCheckUnavailable(
                f"a process group exists and the mesh was given as sizes {dict(plan.mesh.axes)}, not as a DeviceMesh "
                f"of tp={plan.tp}; pass the DeviceMesh (as auto_parallelize does) so the plan is checked as without one")
        _run_blocks(graph, plan, placements, tp_mesh)


@contextlib.contextmanager
def _check_mesh(plan: Plan, mesh: Any) -> Iterator[Any]:
    """The tp mesh the check runs on: a temporary fake group's without a process group, the
    caller's tp axis under one (None when the caller gave sizes, not a DeviceMesh)."""
    if not dist.is_initialized():
        with fake_process_group(plan.tp):
            yield make_mesh({"tp": plan.tp})
    else:
        yield _caller_tp_mesh(mesh, plan)


def _fails_unsharded(module: nn.Module, call, graph: OpGraph | None = None, target: str = "") -> bool:
    """Does the block fail on meta tensors with no plan at all (a meta kernel that refuses a
    dtype, ``autocast("meta")``)? Then a failure of its shards says nothing about the plan.
    With ``graph``, the modules the check stands in for in ``target`` are stood in here too,
    whole."""
    args, kwargs = tree_map_only(torch.Tensor, _on_meta, call.example)
    zeros = _scalar_truths(graph) if graph is not None else {}
    for _ in range(8):
        copy = _meta_copy(module)
        if graph is not None:
            _stand_in(copy, graph, target, lambda value, _fqn: tuple(value.shape))
        stack = _track_modules(copy)
        try:
            with torch.no_grad(), quiet_probes(), nonzero_at_upper_bound(), _scalars(zeros, target):
                copy(*args, **kwargs)
            return False
        except Exception as exc:  # noqa: BLE001 - any failure: the code cannot run on meta here
            # unless a module inside reads values (its stand-in is then used by the sharded run too)
            if graph is not None and _stood_in_for_reader(graph, stack, target, exc, copy):
                continue
            if graph is None or zeros.get(target) is True or not (_reads_values(exc) or (
                    target in zeros and isinstance(exc, AssertionError))):
                return True
            # a value read to decide a warning (read as 0 / False) or to assert (torchtune's cache:
            # ``assert (self.cache_pos[0] + s) <= self.k_cache.shape[2]``, read as True): the
            # block may then run, and its shards are judged the same way
            zeros[target] = target in zeros
    return True


def _reads_scalars_as_zero(graph: OpGraph, target: str, call: Any, exc: BaseException) -> bool:
    """The shards failed reading a value meta tensors lack: from now on ``target`` is run
    reading such values as 0, if its unsharded run then passes (:func:`_fails_unsharded`)."""
    zeros = _scalar_truths(graph)
    if not _reads_values(exc) or target in zeros:
        return False
    return not _fails_unsharded(graph.model.get_submodule(target), call, graph, target) and target in zeros


def _scalar_truths(graph: OpGraph) -> dict[str, bool]:
    """Target -> the truth a meta bool is read as, for the blocks whose run failed reading a
    value meta tensors lack (:func:`_fails_unsharded`); numbers are read as 0."""
    return graph.strategy_cache.setdefault("check reads scalars as 0", {})


def _scalars(truths: dict[str, bool], target: str) -> Any:
    """Run ``target`` as the check runs it: reading values as :func:`_scalar_truths` says."""
    truth = truths.get(target)
    return contextlib.nullcontext() if truth is None else scalars_on_meta_as_zero(truth=truth)


class LocalCheckUnavailable(PlanningError):
    """The local check cannot run here (a process group exists, but no mesh of the plan's tp)."""


def _caller_tp_mesh(mesh: Any, plan: Plan) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        return None
    sub = mesh[plan.mesh.tp_axis] if mesh.ndim > 1 else mesh
    return sub if sub.size() == plan.tp else None


def _custom_leaves(graph: OpGraph) -> list[str]:
    """Weight modules outside the repeated blocks whose class writes its own ``forward``
    (an Embedding that reads ``self.weight.to_local()``): the blocks' run does not reach them."""
    from ..analyze.trace import is_weight_leaf

    blocks = [r for r in set(graph.traced.folded.values()) if r in graph.traced.calls]
    out = []
    for fqn, calls in graph.traced.calls.items():
        module = graph.model.get_submodule(fqn) if fqn else graph.model
        inside = _at_or_under(fqn, blocks)
        if fqn and not inside and is_weight_leaf(module) and calls and fqn not in graph.traced.assumed \
                and not type(module).forward.__module__.startswith("torch.nn."):
            out.append(fqn)
    return out


def _run_blocks(graph: OpGraph, plan: Plan, placements: dict[int, str], mesh: Any) -> None:
    if "" not in _targets(graph):  # the whole model's run covers every module already
        for fqn in _custom_leaves(graph):
            _run_once(graph, plan, placements, mesh, fqn)
    for target in _targets(graph):
        _run_once(graph, plan, placements, mesh, target)


def _run_once(graph: OpGraph, plan: Plan, placements: dict[int, str], mesh: Any, target: str) -> None:
    """``_run_one``, skipped when this graph's run of ``target`` already passed with the same
    rules and placements: a plan found to need a local head count is checked with it while
    the attributes are searched, then again as the plan, and blocks before the failing one
    pass each time."""
    passed = graph.strategy_cache.setdefault("local check passed", set())
    key = (target, _sub_plan(plan, target).model_dump_json(), tuple(sorted(placements.items())))
    if key not in passed:
        _run_one(graph, plan, placements, mesh, target)
        passed.add(key)


def _run_one(graph: OpGraph, plan: Plan, placements: dict[int, str], mesh: Any, target: str) -> None:
    call = graph.traced.calls[target][0]
    block = _meta_copy(graph.model.get_submodule(target))
    shard(block, mesh, _sub_plan(plan, target))
    stand_in_for(block, graph, plan, placements, target)
    _no_gathers_in_sharded_norms(block, _sub_plan(plan, target), target)
    args, kwargs = _local_args(call, placements, plan.tp, target)
    stack = _track_modules(block)
    views: list[tuple[str, tuple[int, ...]]] = []
    try:
        with torch.no_grad(), quiet_probes(), nonzero_at_upper_bound(), _ViewRecorder(block, stack, views), \
                _scalars(_scalar_truths(graph), target):
            block(*args, **kwargs)
    except LocalShapeError:
        raise  # a sharded norm that gathers (_counted): already said
    except Exception as exc:  # noqa: BLE001 - re-raised as a planning error with the line
        if _stood_in_for_reader(graph, stack, target, exc, block) or _reads_scalars_as_zero(graph, target, call, exc):
            # a module whose own code reads values meta tensors lack (a MoE layer that counts
            # its experts' tokens with .tolist()): the block runs again with it stood in,
            # shaped as the trace recorded it, so the code around it (attention) is still checked
            return _run_one(graph, plan, placements, mesh, target)
        leaf = _failing_leaf(block, stack, target)  # a weight module's own forward: it can be kept whole
        calls = graph.traced.calls.get(leaf, []) if leaf is not None else []
        block_fails = functools.cache(lambda: _fails_unsharded(graph.model.get_submodule(target), call, graph, target))
        # it fails whole too (experts routing on meta): not its style's doing. A leaf with no
        # call of its own recorded (export records the root's only) is judged by its block's
        if leaf is not None and (_fails_unsharded(graph.model.get_submodule(leaf), calls[0]) if calls else block_fails()):
            stood = graph.strategy_cache.setdefault("check stands in", set())
            if leaf != target and leaf not in stood and _reads_values(exc) and _module_op(graph, leaf) is not None:
                # its own code needs values meta tensors lack (experts that split their rows by
                # counts read with .tolist()): the block runs again with it stood in, shaped as
                # the trace recorded it, so the code around it (attention) is still checked
                stood.add(leaf)
                return _run_one(graph, plan, placements, mesh, target)
            leaf = None
        if leaf is None and block_fails():
            raise LocalShapeError(
                f"{target or type(graph.model).__name__}: its code fails on the meta device even unsharded, at "
                f"{_user_frame(exc)}: {_said(exc)}; the check cannot "
                "judge its shards (run `shardplan verify` on a small configuration)", None) from None
        culprit = _culprit(block, stack, target)
        raise LocalShapeError(
            f"{culprit or type(graph.model).__name__}: running its shards at tp={plan.tp} fails at "
            f"{_user_frame(exc)}: {_said(exc)}. The code uses a "
            "global size (a head count or width) where a shard holds 1/tp of it: compute it from the "
            "tensor (view(b, s, -1, head_dim)), or let that module run whole (the default without strict)",
            culprit, leaf,
        ) from None
    _check_views(graph, plan, placements, target, views)


def _no_gathers_in_sharded_norms(block: nn.Module, plan: Plan, target: str) -> None:
    """Each ``norm_sharded`` module of ``block`` counts the collectives its code makes on
    DTensors; one that gathers its features (a LayerNorm whose ``var`` DTensor runs whole)
    raises, and the planner keeps it whole: the strategy was priced at one all-reduce."""
    for rule in (r for r in plan.rules if r.style == "norm_sharded"):
        for name in expand_pattern(rule.module, plan.model.repeats):
            module = block.get_submodule(name)
            # the copy's own forward, wrapped (hooks outside it keep making its input a DTensor):
            # the mode is left however the forward ends
            module.forward = functools.partial(_counted, module.forward, f"{target}.{name}" if target else name)


def _counted(forward: Callable, fqn: str, *args: Any, **kwargs: Any) -> Any:
    with record_collectives(1) as events:
        out = forward(*args, **kwargs)
    gathers = dict(Counter(kind for kind, *_ in events if kind != "all_reduce"))
    if gathers:
        raise LocalShapeError(f"{fqn}: its code on features split tp ways makes {gathers} (DTensor runs part of it "
                              "on whole features), not one all-reduce: it runs whole", fqn, fqn, collectives=True)
    return out


def _reads_values(exc: BaseException) -> bool:
    """A meta tensor asked for its values (``.tolist()``, ``.item()``), or an op with no meta
    kernel (``bincount``): code meta cannot run, whatever the plan, not a size the plan got wrong."""
    text = str(exc)
    return ("Cannot copy out of meta tensor" in text or ("item()" in text and "meta" in text)
            or "attempted to run this operator with Meta tensors" in text)


class _Shaped(nn.Module):
    """A weight module's place in a check: returns a meta tensor of its output's planned
    local shape, as the trace recorded it, whatever it is handed."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def _module_op(graph: OpGraph, fqn: str) -> Any:
    """The one call of weight module ``fqn`` with one output in the op graph, or None."""
    ops = [op for op in graph.ops if op.kind == "module" and op.target == fqn and op.output is not None]
    return ops[0] if len(ops) == 1 else None


def _output_value(graph: OpGraph, fqn: str) -> Any:
    """The value module ``fqn`` returns at its one call: a weight module's op's, or what the
    trace recorded for a module it ran through; None for several calls or outputs."""
    op = _module_op(graph, fqn)
    if op is not None:
        return graph.values[op.output]
    calls = graph.traced.calls.get(fqn, [])
    if len(calls) != 1 or len(calls[0].outputs) != 1 or calls[0].items:
        return None
    return graph.value_of(calls[0].outputs[0])


def _stood_in_for_reader(graph: OpGraph, stack: list[str], target: str, exc: BaseException, block: nn.Module) -> bool:
    """When ``exc`` is code asking a meta tensor for values, mark the module that asked
    (:func:`_value_reader`) to be stood in for; True when one was, so the run can be retried.
    Not when the asking code is a method of a module that is not running its forward (a KV
    cache's ``update``, called by the attention): standing in the running module would hide
    the attention from the check; :func:`_reads_scalars_as_zero` runs it instead."""
    helper = _raising_module(block, exc)
    if helper is not None and helper not in stack:
        return False
    reader = _value_reader(graph, stack, target) if _reads_values(exc) else None
    if reader is not None:
        graph.strategy_cache.setdefault("check stands in", set()).add(reader)
    return reader is not None


def _raising_module(block: nn.Module, exc: BaseException) -> str | None:
    """The name in ``block`` of the module whose method raised ``exc`` (its innermost frame
    with a ``self`` of ``block``), or None."""
    names = {id(m): n for n, m in block.named_modules()}
    tb, found = exc.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        found = names.get(id(owner), found) if isinstance(owner, nn.Module) else found
        tb = tb.tb_next
    return found


def _value_reader(graph: OpGraph, stack: list[str], target: str) -> str | None:
    """The innermost running module under ``target`` (not ``target`` itself) that a check can
    stand in for, not already stood in: the one whose code asked a meta tensor for values."""
    stood = graph.strategy_cache.get("check stands in", set())
    for name in reversed(stack):
        fqn = ".".join(n for n in (target, name) if n)
        if name and fqn not in stood and _output_value(graph, fqn) is not None:
            return fqn
    return None


def stand_in_for(block: nn.Module, graph: OpGraph, plan: Plan, placements: dict[int, str], target: str) -> None:
    """Put :class:`_Shaped` in ``block`` (a sharded meta copy of ``target``) in place of each
    module under it whose own code the check found cannot run on meta. It returns what the
    module hands its caller: where the plan converts the value as that module returns it (a
    MoE's output cut or reduce-scattered onto sequence shards), the converted shape, since the
    conversion's hook went with the module it replaced."""
    exits = getattr(placements, "exits", {})

    def returned(value: Any, fqn: str) -> tuple[int, ...]:
        module, p = exits.get(value.id, (None, None))
        return local_shape(value.shape, p if module == fqn else placements.get(value.id, "R"), plan.tp)

    _stand_in(block, graph, target, returned)


def _stand_in(block: nn.Module, graph: OpGraph, target: str, shape_of: Callable[[Any, str], tuple[int, ...]]) -> None:
    for fqn in sorted(graph.strategy_cache.get("check stands in", ())):
        if target and not fqn.startswith(target + "."):
            continue
        value = _output_value(graph, fqn)
        parent, _, name = (fqn[len(target) + 1:] if target else fqn).rpartition(".")
        (block.get_submodule(parent) if parent else block)._modules[name] = _Shaped(shape_of(value, fqn), value.dtype)


def _said(exc: Exception) -> str:
    """The exception's type and first line (a bare ``assert`` has no message)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__


class _ViewRecorder(TorchFunctionMode):
    """Records (running module, output shape) of every view and reshape the code makes
    outside its weight modules."""

    def __init__(self, block: nn.Module, stack: list[str], views: list) -> None:
        super().__init__()
        from ..analyze.trace import is_weight_leaf

        self.stack, self.views = stack, views
        self.leaves = {name for name, sub in block.named_modules() if is_weight_leaf(sub)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inside = self.stack[-1] if self.stack else ""
        if getattr(func, "__name__", "") in _SIZED_OPS and isinstance(out, torch.Tensor) and inside not in self.leaves:
            self.views.append((inside, tuple(out.shape)))
        return out


def _check_views(graph: OpGraph, plan: Plan, placements: dict[int, str], target: str, views: list) -> None:
    """Running is not enough: ``view(bsz, -1, self.num_heads, self.head_dim)`` with the global
    head count runs on a shard too, its ``-1`` absorbing the split into the sequence dim. Each
    module's views must give, in order, the local shapes the plan expects of those values;
    the first module whose views do not is a LocalShapeError, so its attributes are tried."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in views:
        seen.setdefault(f"{target}.{name}" if target and name else (name or target), []).append(shape)
    for fqn, want in _expected_views(graph, placements, target, plan.tp).items():
        got = iter(seen.get(fqn, []))
        missing = next((w for w in want if not any(shape == w for shape in got)), None)
        if missing is not None:
            raise LocalShapeError(
                f"{fqn}: running its shards at tp={plan.tp}, a view does not give the local shape "
                f"{list(missing)} the plan expects (its views gave {[list(v) for v in seen.get(fqn, [])][:4]}). The "
                "code uses a global size (a head count or width) where a shard holds 1/tp of it", fqn, None)


def _expected_views(graph: OpGraph, placements: dict[int, str], target: str, tp: int) -> dict[str, list]:
    """Per module inside ``target`` whose own code views a split value: the local shapes, in
    trace order (a reshape after a kv repeat left out, as the code may skip the repeat)."""
    out: dict[str, list] = {}
    for op in _view_ops(graph, placements, target, tp):
        placement = placements.get(op.output, "R")
        if placement not in ("R", "Rp"):
            out.setdefault(op.owner, []).append(_local_shape(graph.values[op.output].shape, placement, tp))
    return out


def _view_ops(graph: OpGraph, placements: dict[int, str], target: str, tp: int) -> list:
    """The views and reshapes the code inside ``target`` makes, in trace order, less those of
    a value whose kv heads were expanded (with one copy per rank the code may skip that
    repeat altogether: HF's repeat_kv returns at n_rep == 1), and those inside a module the
    check stands in for (they never run)."""
    stood = graph.strategy_cache.get("check stands in", ())
    end = _first_call_end(graph, target)
    return [op for op in graph.ops if op.kind == "function" and op.target in _SIZED_OPS
            and (end is None or op.index <= end)
            and (not target or op.owner == target or op.owner.startswith(target + "."))
            and not any(op.owner == s or op.owner.startswith(s + ".") for s in stood)
            and (not op.inputs or (groups_of(placements.get(op.inputs[0], "R")) or ("",))[0] != "e")
            and not _after_one_head_repeat(graph, placements, op, tp)]


def _first_call_end(graph: OpGraph, target: str) -> int | None:
    """The last op of ``target``'s first call when the forward calls it more than once (ALBERT's
    one layer, shared by every position): the check runs that call only, so only its views
    are expected. None when it is called once."""
    calls = graph.traced.calls.get(target, []) if target else []
    ends = [n.meta["shardplan_op"] for n in (calls[0].outputs if len(calls) > 1 else []) if "shardplan_op" in n.meta]
    return max(ends) if ends else None


def _after_one_head_repeat(graph: OpGraph, placements: dict[int, str], op, tp: int) -> bool:
    """A view of one whole kv head (``Rp``) repeated to the rank's query heads, one query head
    per rank: the code may skip that repeat and its view (HF's repeat_kv at n_rep == 1)."""
    producer = graph.ops[graph.values[op.inputs[0]].producer] if op.inputs and op.inputs[0] in graph.values else None
    if producer is None or producer.target not in BROADCASTS or not producer.inputs \
            or placements.get(producer.inputs[0]) != "Rp":
        return False
    out = graph.values[producer.output]
    d = shard_dim(placements.get(producer.output, "R"))
    return d is not None and out.shape[d] == tp


# ops whose output shape the code spells out: views, and constants made from sizes alone
# (T5's ``torch.zeros(1, self.n_heads, q, k)`` split by heads). Broadcasting hides a global
# size in either (an attention mask of every head beside one rank's heads runs on meta), so
# their shapes are compared with the plan's, not only run.
_SIZED_OPS = {"view", "reshape", "unflatten", "zeros", "ones", "full", "empty"}


_local_shape = local_shape
