"""Export: the second front end, ``torch.export`` -> the same fx graph the meta tracer builds.

Contract
--------
``export_trace(model, example_inputs, example_kwargs=None)`` returns a
:class:`~shardplan.analyze.trace.Traced` for code the meta fx tracer cannot follow: a module
created inside ``forward``, ``callable(arg)`` tests on arguments, ``torch.autocast(device_type=
x.device.type)``, Python control flow on shapes through objects fx cannot spell. It runs
``torch.export.export(..., strict=False)`` on fake tensors (FakeTensorMode, device ``cpu``:
nothing is allocated, and a meta model exports although ``autocast("meta")`` would not), then
rewrites the exported ATen graph into the meta tracer's form:

* the ops each weight-owning leaf module ran (``nn_module_stack``) become one
  ``call_module`` node with that module's FQN, its inputs the tensors it read from outside;
* the ops between them stay ``call_function`` nodes on ATen overloads (the op graph names
  them by their packet, ``aten.view.default`` -> ``view``, so the same strategies apply, and
  DTensor's sharding propagation answers for the rest);
* parameters and buffers read outside a leaf become ``get_attr`` nodes of their FQN;
* higher-order ops (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``) are inlined;
* ``node.meta["val"]`` holds meta tensors with the global shapes.

Repeated blocks fold as the meta tracer folds them (``fold_repeated``, the same
:func:`~shardplan.analyze.trace._repeated_groups` rule): during the export every block of a
group but the first (the representative) runs as one opaque op, ``shardplan::folded_block``,
returning tensors shaped as the representative's outputs were for the same input shapes, so
its body is never traced and an 80-layer model exports and solves as one layer. The rewrite
makes each such op a ``call_module`` node of the copy (``Traced.folded`` maps it to the
representative). The representative's tensor inputs and outputs pass through
``shardplan::mark`` (an identity the rewrite drops), which says which graph values its call
read and returned: its :class:`~shardplan.analyze.trace.ModuleCall`, as the meta tracer
records it. A copy called with other input shapes or types than the representative's first
call, or a representative whose output is not a tensor or a flat tuple of tensors and
constants, is traced through instead. The wrapping is on the blocks' classes for the
export only: their own ``forward`` is put back on success and on error.

Apart from those blocks, only the root's call is recorded. The meta tracer stays the fast
path; :func:`shardplan.plan_model` uses this one only when that one fails.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import warnings
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_map_only, tree_unflatten

from .exportfold import BlockCall, Folder, Slot, count_slots, filled, registered_ops
from .snapshot import preserved
from .trace import ModuleCall, Traced, TraceError, _repeated_groups, is_weight_leaf
from .values import UPPER_BOUND_NOTE

__all__ = ["export_trace", "UPPER_BOUND_NOTE"]

# ops that check metadata and return nothing: kept, they would pin their input whole
_DROPPED = {"_assert_tensor_metadata", "_assert_async", "sym_constrain_range_for_size", "_assert_scalar"}


def export_trace(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None = None, *,
                 fold_repeated: bool = True) -> Traced:
    """``model`` through ``torch.export`` on fake tensors, as a :class:`Traced`."""
    kwargs = dict(example_kwargs or {})
    folder = Folder(model, _repeated_groups(model) if fold_repeated else {})
    try:
        ep = _export(model, tuple(example_inputs), kwargs, folder)
    except Exception as exc:  # noqa: BLE001 - torch.export's many error types, said in one line
        raise TraceError(f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0][:300]}") from exc
    flat = _inline(ep.graph_module)
    sig = ep.graph_signature
    state = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    rewriter = _Rewriter(model, state, folder)
    graph, placeholders, outputs = rewriter.run(flat)
    args, kw = _root_nodes(model, placeholders, tuple(example_inputs), kwargs)
    calls = {"": [ModuleCall("", args, kw, outputs, _meta_example(example_inputs, kwargs))]}
    for fqn, found in rewriter.block_calls().items():
        calls.setdefault(fqn, []).extend(found)
    notes = [UPPER_BOUND_NOTE] if _data_dependent(flat) else []
    return Traced(graph=graph, model=model, calls=calls, folded=rewriter.folded, notes=notes, front_end="export")


def _data_dependent(graph: torch.fx.Graph) -> bool:
    return any(isinstance(n, torch.SymInt) and n.node.expr.free_symbols and not n.node.has_hint()
               for node in graph.nodes for v in [node.meta.get("val")] if isinstance(v, torch.Tensor) for n in v.shape)


def _root_nodes(model: nn.Module, placeholders: list, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """Which placeholder each tensor argument became: export orders the user inputs as the
    positional tensors, then the keyword tensors in ``forward``'s parameter order."""
    order = list(inspect.signature(model.forward).parameters)
    names = sorted((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)),
                   key=lambda k: order.index(k) if k in order else len(order))
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    nodes: list = [None] * len(args)
    if len(placeholders) != len(positions) + len(names):
        return nodes, {}  # inputs export flattened otherwise (nested structures): not mapped
    for i, p in zip(positions, placeholders):
        nodes[i] = p
    return nodes, dict(zip(names, placeholders[len(positions):]))


def _export(model: nn.Module, args: tuple, kwargs: dict, folder: Folder | None = None) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")

    # one entry per tensor: tie_weights gives a tied weight's other names the same fake
    state: dict[str, torch.Tensor] = {
        n: nn.Parameter(fake(p), requires_grad=p.requires_grad) for n, p in model.named_parameters()
    }
    state.update({n: fake(b) for n, b in model.named_buffers()})
    fake_args = tree_map_only(torch.Tensor, fake, args)
    fake_kwargs = tree_map_only(torch.Tensor, fake, kwargs)
    # preserved: whatever forward did on fake tensors (registered a buffer, cached a tensor:
    # x-transformers' ALiBi ``self.bias = ...``; a module registered under two names whose
    # restore wrote the fake back: a tied ``token_emb``) is undone, since a fake tensor left
    # in the model breaks every later copy of it and the user's next forward
    with preserved(model), _reparametrize_module(model, state, tie_weights=True), _quiet(), \
            (folder.installed() if folder is not None else contextlib.nullcontext()):
        return torch.export.export(model, fake_args, fake_kwargs, strict=False)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export prints the graph it gave up on, logs guard warnings, and fake tensors
    log every failing kernel with its traceback (``log.exception``: 117 lines for one shape
    bug in a user's model, through handlers that hold the real stderr); the failure reaches
    the user once, as the TraceError's message."""
    quiet = {"torch.fx.experimental.symbolic_shapes": logging.ERROR, "torch._subclasses.fake_tensor": logging.CRITICAL}
    logs = {name: logging.getLogger(name) for name in quiet}
    levels = {name: log.level for name, log in logs.items()}
    for name, log in logs.items():
        log.setLevel(quiet[name])
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, log in logs.items():
            log.setLevel(levels[name])


def _meta_example(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map_only(torch.Tensor, _to_meta, tuple(args)), tree_map_only(torch.Tensor, _to_meta, kwargs)


def _to_meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        shape = tuple(_concrete(n) for n in val.shape)
        if any(isinstance(n, torch.SymInt) for n in (*val.shape, *val.stride())):  # contiguous at its bound
            return torch.empty(shape, dtype=val.dtype, device="meta")
        return torch.empty_strided(shape, tuple(val.stride()), dtype=val.dtype, device="meta")
    if isinstance(val, (tuple, list)):
        return type(val)(_to_meta(v) for v in val)
    return val


def _concrete(n: Any) -> Any:
    """A size as an int. A data-dependent one (the rows ``nonzero``/``torch.where``/a boolean
    index selects, as MoE dispatch does) is unbacked in export's graph: it is taken at the
    upper bound export's shape environment knows for it (every row selected), so the planner
    prices each expert as if all tokens reached it, and never compares symbols."""
    if not isinstance(n, torch.SymInt):
        return n
    node = n.node
    if not node.expr.free_symbols or node.has_hint():
        return int(node.require_hint()) if node.expr.free_symbols else int(node.expr)
    from torch.utils._sympy.numbers import int_oo

    upper = node.shape_env.bound_sympy(node.expr).upper
    # torch's integer infinity says it is finite (int_oo.is_finite is True); sympy's does not
    if upper == int_oo or not upper.is_finite or not upper.is_number:
        raise TraceError(f"torch.export graph: a data-dependent size ({node.expr}) has no upper bound; "
                         "plan a model whose sizes follow from its inputs' shapes")
    return int(upper)


# --------------------------------------------------------------------------- folding


def _inline(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of ``gm``'s graph with the bodies of higher-order ops (autocast, grad mode)
    copied in place of the calls."""
    out = torch.fx.Graph()
    _copy_into(gm, out, None)
    return out


def _copy_into(gm: torch.fx.GraphModule, out: torch.fx.Graph, inputs: list | None) -> Any:
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = _copy_placeholder(node, out) if inputs is None else inputs.pop(0)
        elif node.op == "output":
            result = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
            if inputs is None:
                out.output(result)
            return result
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            env[node] = getattr(gm, node.target)
        elif _body(node, env) is not None:
            body, operands = _body(node, env)
            env[node] = _copy_into(body, out, [env[a] if isinstance(a, torch.fx.Node) else a for a in operands])
        elif node.target is operator.getitem and isinstance(env.get(node.args[0]), (tuple, list)):
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = out.node_copy(node, lambda n: env[n])
    return None


def _copy_placeholder(node: torch.fx.Node, out: torch.fx.Graph) -> torch.fx.Node:
    new = out.placeholder(node.name)
    new.meta = dict(node.meta)
    return new


def _body(node: torch.fx.Node, env: dict) -> tuple[torch.fx.GraphModule, tuple] | None:
    """A higher-order op's body graph and the operands it is called with."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and isinstance(env.get(a), torch.fx.GraphModule):
            return env[a], node.args[i + 1:]
    raise TraceError(f"torch.export recorded {node.target.name()}, a higher-order op shardplan cannot read")


# --------------------------------------------------------------------------- leaves


class _Rewriter:
    """Copies the flat ATen graph, folding each weight leaf's ops into one call_module."""

    def __init__(self, model: nn.Module, state: dict[str, str], folder: Folder | None = None) -> None:
        self.model, self.state = model, state
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.consts: dict[str, torch.fx.Node] = {}
        self.leaf_of: dict[str, bool] = {}
        self.folder = folder or Folder(model, {})
        self.marks: dict[tuple[int, int], torch.fx.Node] = {}  # (call id, slot) -> the value marked
        self.copies: dict[torch.fx.Node, tuple[torch.fx.Node, BlockCall]] = {}  # folded_block -> its call_module
        self.folded: dict[str, str] = {}  # copy -> representative, for the copies that folded

    def run(self, flat: torch.fx.Graph) -> tuple[torch.fx.Graph, list[torch.fx.Node], list[torch.fx.Node]]:
        users = {n: list(n.users) for n in flat.nodes}
        placeholders, outputs, group, leaf = [], [], [], None
        ops = registered_ops()
        mark, block = (ops[0]._opoverload, ops[1]._opoverload) if ops is not None else (None, None)
        for node in flat.nodes:
            special = node.op == "call_function" and node.target in (mark, block) and mark is not None
            this = self._leaf(node) if node.op == "call_function" and not special else None
            if group and this != leaf:
                self._emit_leaf(leaf, group, users)
                group = []
            if this is not None:
                group, leaf = group + [node], this
            elif special and node.target == mark:
                self.env[node] = self._arg(node.args[0])
                self.marks[(node.args[1], node.args[2])] = self.env[node]
            elif special:
                self._emit_copy(node)
            elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.copies:
                self._copy_item(node)
            elif node.op == "placeholder":
                if node.name not in self.state:
                    placeholders.append(self._placeholder(node))
            elif node.op == "output":
                outputs = self._output(node)
            elif not _dropped(node):
                self.env[node] = self._copy(node)
        return self.graph, placeholders, outputs

    def _emit_copy(self, node: torch.fx.Node) -> None:
        """A folded copy's ``shardplan::folded_block``: one call_module node of the copy, its
        arguments as the call passed them, its value the representative's outputs."""
        tensors, cid = node.args
        call = self.folder.calls[cid]
        args, kwargs = tree_unflatten(filled(call.leaves, [self._arg(n) for n in tensors]), call.spec)
        new = self.graph.call_module(call.fqn, tuple(args), dict(kwargs))
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        if stack and stack[-1][1][0] == call.fqn:  # the copy's own entry: the node is its call, made outside it
            stack = stack[:-1]
        new.meta["nn_module_stack"] = dict(stack)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        metas = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in call.out_metas]
        new.meta["val"] = tree_unflatten(filled(call.out_leaves, metas), call.out_spec)
        self.copies[node] = (new, call)
        self.folded[call.fqn] = call.rep

    def _copy_item(self, node: torch.fx.Node) -> None:
        """``outputs[i]`` of a folded copy: the call itself where the block returns one tensor,
        else the item of its tuple that held the ``i``-th tensor."""
        new, call = self.copies[node.args[0]]
        if not isinstance(new.meta["val"], (tuple, list)):
            self.env[node] = new
            return
        index = next(k for k, v in enumerate(call.out_leaves) if v == Slot(node.args[1]))
        item = self.graph.call_function(operator.getitem, (new, index))
        item.meta = {"val": new.meta["val"][index], "nn_module_stack": new.meta["nn_module_stack"]}
        self.env[node] = item

    def block_calls(self) -> dict[str, list[ModuleCall]]:
        """Each representative's and folded copy's calls, as the meta tracer records them."""
        found: dict[str, list[ModuleCall]] = {}
        copy_nodes = {id(call): new for new, call in self.copies.values()}
        for cid, call in self.folder.calls.items():
            if call.copy:  # as the meta tracer records a folded copy: its node is its output
                new = copy_nodes.get(id(call))
                if new is None:
                    continue
                args, kwargs, outputs, items = new.args, new.kwargs, [new], {}
            else:
                args, kwargs = tree_unflatten(
                    filled(call.leaves, [self.marks.get((cid, i)) for i in range(count_slots(call.leaves))]), call.spec)
                outs = [self.marks.get((cid, -1 - i)) for i in range(len(call.out_metas))]
                outputs = [n for n in outs if n is not None]
                items = {k: outs[v.index] for k, v in enumerate(call.out_leaves)
                         if isinstance(v, Slot) and outs[v.index] is not None} \
                    if call.out_spec is not None and call.out_spec.type in (tuple, list) else {}
            arg_nodes = [a if isinstance(a, torch.fx.Node) else None for a in args]
            kw_nodes = {k: v for k, v in kwargs.items() if isinstance(v, torch.fx.Node)}
            example = _meta_example(*call.example)
            num = len(call.out_leaves) if call.out_spec is not None and call.out_spec.type in (tuple, list) else 0
            found.setdefault(call.fqn, []).append(ModuleCall(call.fqn, arg_nodes, kw_nodes, outputs, example, items, num))
        return found

    def _leaf(self, node: torch.fx.Node) -> str | None:
        """The weight leaf whose call ran ``node``: the outermost one on its module stack, so
        the ops of a parameter-free child the leaf calls (DeepSeek-V4's experts calling their
        ``act_fn`` between the two matmuls) stay in the leaf's one call."""
        stack = node.meta.get("nn_module_stack") or {}
        return next((fqn for fqn, _ in stack.values() if self._is_leaf(fqn)), None)

    def _is_leaf(self, fqn: str) -> bool:
        if fqn not in self.leaf_of:
            try:
                self.leaf_of[fqn] = bool(fqn) and is_weight_leaf(self.model.get_submodule(fqn))
            except AttributeError:
                self.leaf_of[fqn] = False
        return self.leaf_of[fqn]

    def _placeholder(self, node: torch.fx.Node) -> torch.fx.Node:
        new = self.graph.placeholder(node.name)
        new.meta["val"] = _to_meta(node.meta.get("val"))
        self.env[node] = new
        return new

    def _arg(self, n: torch.fx.Node) -> torch.fx.Node:
        if n in self.env:
            return self.env[n]
        fqn = self.state.get(n.name)
        if fqn is None:
            raise TraceError(f"torch.export graph: {n.name} is used before it is defined")
        if fqn not in self.consts:  # a parameter or buffer read outside a leaf (RoPE table, sinks)
            const = self.graph.get_attr(fqn)
            const.meta["val"] = _to_meta(n.meta.get("val"))
            self.consts[fqn] = const
        return self.consts[fqn]

    def _copy(self, node: torch.fx.Node) -> torch.fx.Node:
        new = self.graph.node_copy(node, self._arg)
        new.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
        new.meta["val"] = _to_meta(node.meta.get("val"))
        return new

    def _output(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        result = torch.fx.node.map_arg(node.args[0], self._arg)
        self.graph.output(result)
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg(result, found.append)
        return found

    def _emit_leaf(self, fqn: str, group: list[torch.fx.Node], users: dict) -> None:
        """One call_module node for the leaf's ops: its inputs are what it read from outside
        (parameters and buffers excepted), its output what is used after it."""
        inside = set(group)
        inputs: list[torch.fx.Node] = []
        for node in group:
            for a in node.all_input_nodes:
                if a not in inside and a.name not in self.state and a not in inputs:
                    inputs.append(a)
        escaping = [n for n in group if any(u not in inside for u in users[n])]
        call = self.graph.call_module(fqn, tuple(self.env[a] for a in inputs))
        call.meta["nn_module_stack"] = dict(list((group[0].meta.get("nn_module_stack") or {}).items())[:-1])
        call.meta["stack_trace"] = group[0].meta.get("stack_trace")
        vals = [_to_meta(n.meta.get("val")) for n in escaping]
        if len(escaping) == 1:
            call.meta["val"] = vals[0]
            self.env[escaping[0]] = call
            return
        call.meta["val"] = tuple(vals)
        for i, n in enumerate(escaping):
            item = self.graph.call_function(operator.getitem, (call, i))
            item.meta = {"val": vals[i], "nn_module_stack": call.meta["nn_module_stack"]}
            self.env[n] = item


def _dropped(node: torch.fx.Node) -> bool:
    target = node.target
    name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", "")
    return node.op == "call_function" and name in _DROPPED
