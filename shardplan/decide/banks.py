"""Expert banks: which modules hold experts and how the model calls them (names and shapes only).

Contract
--------
``routed_banks(graph)`` lists the 3-D expert banks called in one of the three ways expert
parallelism dispatches (:func:`bank_call`): ``bank(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`` (Hugging Face's routed banks), ``bank(num_tokens_per_expert [E],
rows [N, H])`` on rows sorted by expert (torchtitan's), or ``bank(rows [E T, H])``, every
token once per expert (Llama 4's). ``listed_banks(graph)`` lists the experts written as an
``nn.ModuleList`` of alike modules that the layer's own code calls after a router. Each is a
:class:`Bank`: its module, E, the tokens T and top-k k of a call, the hidden width, and how
often it runs per step. Nothing here prices or plans: :mod:`.experts` and :mod:`.weights`
read these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ..analyze.graph import EXPERT_CONTAINERS, OpGraph, router_like, rows_width

__all__ = ["Bank", "bank_call", "routed_banks", "listed_banks", "expert_count", "inside", "routes"]


@dataclass(frozen=True)
class Bank:
    module: str  # the bank's FQN (a folded stack's representative)
    experts: int
    tokens: int  # T at its call, per rank
    top_k: int
    hidden: int
    calls: int  # per step: the op's multiplicity
    listed: bool = False  # an nn.ModuleList of experts, each its own module (module: the list)


def routed_banks(graph: OpGraph, *, unread: list[str] | None = None) -> list[Bank]:
    """Expert banks called as ``bank(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``
    or, on rows sorted by expert, ``bank(num_tokens_per_expert [E], rows [N, H])``
    (torchtitan's; a bank of N rows at top-1). A bank called otherwise (a shared expert
    written as a bank, Llama 4's bank of every token) is not one: it is listed in ``unread``
    as ``"<fqn>: <shapes>"`` when a list is given."""
    out = []
    for op in graph.ops:
        if op.kind != "module" or op.module_kind != "experts":
            continue
        bank = bank_call(graph, op)
        if bank is not None:
            out.append(bank)
        elif unread is not None:
            unread.append(f"{op.target}: called with tensors of shapes {[tuple(graph.values[v].shape) for v in op.inputs]}")
    return out


def bank_call(graph: OpGraph, op) -> Bank | None:
    """The bank experts module ``op`` calls, when it is called in one of the three ways
    expert parallelism dispatches (the routed, sorted-rows and every-token calls of
    :func:`routed_banks`), else None."""
    shapes = [tuple(graph.values[v].shape) for v in op.inputs]
    dtypes = [graph.values[v].dtype for v in op.inputs]
    experts = int(next(graph.model.get_submodule(op.target).parameters(recurse=False)).shape[0])
    if routed := _routed(shapes, dtypes):
        return Bank(op.target, experts, *routed, op.multiplicity)
    if rows := _sorted_rows(shapes, dtypes, experts):
        return Bank(op.target, experts, rows[0], 1, rows[1], op.multiplicity)
    if _every_token(graph, op, shapes, dtypes, experts):  # each token sent to every expert: top-k is E
        return Bank(op.target, experts, shapes[0][0] // experts, experts, shapes[0][1], op.multiplicity)
    return None


def _routed(shapes: list[tuple], dtypes: list) -> tuple[int, int, int] | None:
    """``(T, k, H)`` of a call with hidden [T, H], top_k_index [T, k] (integers) and
    top_k_weights [T, k], whatever order the front end lists them in (export's graph does
    not keep the call's); None for any other call."""
    if len(shapes) != 3 or any(len(s) != 2 for s in shapes):
        return None
    index = [i for i, d in enumerate(dtypes) if not d.is_floating_point]
    if len(index) != 1:
        return None
    weights = [i for i in range(3) if i != index[0] and shapes[i] == shapes[index[0]] and dtypes[i].is_floating_point]
    hidden = [i for i in range(3) if i not in index + weights[:1]]
    if not weights or len(hidden) != 1 or shapes[hidden[0]][0] != shapes[index[0]][0]:
        return None
    (tokens, width), k = shapes[hidden[0]], shapes[index[0]][1]
    return tokens, k, width


def _sorted_rows(shapes: list[tuple], dtypes: list, experts: int) -> tuple | None:
    """The rows' shape ``[N, H]`` of a call with counts [E] (integers) and rows sorted by expert,
    in either order (torchtitan passes rows first); None for any other call."""
    if len(shapes) != 2:
        return None
    (counts, c_type), (rows, r_type) = sorted(zip(shapes, dtypes), key=lambda sd: len(sd[0]))
    found = counts == (experts,) and not c_type.is_floating_point and len(rows) == 2 and r_type.is_floating_point
    return rows if found else None


def listed_banks(graph: OpGraph, *, unread: list[str] | None = None) -> list[Bank]:
    """Experts written as an ``nn.ModuleList`` (or ``ModuleDict``, ``Sequential``) of alike
    modules, each called by its layer's own code on the rows a router chose: the list's layer runs a Linear of E outputs (the
    router) before the first expert. ``tokens`` is the router's rows, ``top_k`` the k of a
    ``topk`` in the layer's code (1 without one). An expert that does not map ``[n, H]`` to
    ``[n, H]`` is listed in ``unread``."""
    modules = [op for op in graph.ops if op.kind == "module"]
    out = []
    for path, experts in graph.model.named_modules():
        if not isinstance(experts, EXPERT_CONTAINERS) or len(experts) < 2 or not _alike(experts) \
                or _chained(graph, path, list(experts._modules)):
            continue
        calls = [op for op in modules if op.target.startswith(f"{path}.")]
        parent = path.rpartition(".")[0]
        router = next((op for op in graph.ops if calls and op.index < calls[0].index and op.output is not None
                       and routes(op, graph, parent, len(experts))), None)
        if router is None:
            continue
        first, last = (graph.values[calls[0].inputs[0]].shape, graph.values[calls[-1].output].shape)
        why = (f"experts map rows of {first[-1]} features to {last[-1]}" if first[-1] != last[-1]
               else _more_than_rows(graph, path, list(experts._modules)) or _no_linear(experts))
        if why:
            if unread is not None:
                unread.append(f"{path}: {why}")
            continue
        # a router module of its own returns its choice, [T, k]; a Linear's E scores meet a topk in the layer
        k = graph.values[router.output].shape[-1] if router.kind == "module" and router.module_kind != "linear" \
            else _top_k(graph, parent, len(experts))
        out.append(Bank(path, len(experts), _router_rows(graph, router), k, first[-1],
                        router.multiplicity, listed=True))
    return out


def _more_than_rows(graph: OpGraph, path: str, names: list[str]) -> str:
    """Why the list's experts cannot be sent their rows alone ("" when they can): the dispatch
    sends one tensor of rows [n, H] per expert call, and an expert called with more (its own
    routing weights, ``expert(x[idx], w[idx])``) would lose them on another rank."""
    for name in names:
        for call in graph.traced.calls.get(f"{path}.{name}", []):
            given = sum(a is not None for a in call.args) + len(call.kwargs)
            if given != 1:
                return (f"expert {name} is called with {given} tensors; expert parallelism of a list sends each "
                        "expert one tensor of rows [n, H] (apply the routing weights to its output in the layer)")
    return ""


def _no_linear(experts: nn.Module) -> str:
    """Why the ranks could not size the rows they receive ("" when they can): the dispatch
    reads an expert's row width off its first Linear's ``in_features``."""
    first = next(experts.children())
    if rows_width(first) is not None:
        return ""
    return (f"its experts ({type(first).__name__}) hold no Linear to read their rows' width from; expert parallelism "
            "of a module list needs experts made of Linears (or a 3-D bank [E, ...] called with its routing)")


def _chained(graph: OpGraph, path: str, names: list[str]) -> bool:
    """The list's second entry reads what its first returned (stacked layers, not experts)."""
    first, second = (graph.traced.calls.get(f"{path}.{name}") for name in names[:2])
    if not first or not second or not second[0].args or second[0].args[0] is None:
        return False
    outputs, seen, todo = set(first[0].outputs), set(), [second[0].args[0]]
    while todo:
        node = todo.pop()
        if node in outputs:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return False


def routes(op, graph: OpGraph, layer: str, experts: int) -> bool:
    """A router of ``experts`` outputs in ``layer``: a Linear module or a matmul in its code
    (``F.linear(x, self.weight)``) giving E scores per row, or a router module of its own
    (a ``weight`` [E, H] and a top-k in its class: DeepSeek's ``MoEGate``, returning the
    chosen experts and their weights, not E scores)."""
    if op.kind == "module" and inside(op.target, layer) and router_like(graph.model.get_submodule(op.target)):
        return graph.model.get_submodule(op.target).weight.shape[0] == experts
    if graph.values[op.output].shape[-1:] != (experts,):
        return False
    if op.kind == "module":
        return op.module_kind == "linear" and inside(op.target, layer)
    return (op.kind == "function" and op.target in _MATMULS and op.output in graph.values
            and inside(op.owner, layer))


_MATMULS = ("linear", "matmul", "mm", "einsum")


def _alike(experts: nn.Module) -> bool:
    """Every entry the same class with the same parameter names and shapes, and some."""
    shapes = {(type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in experts.children()}
    return len(shapes) == 1 and bool(next(iter(shapes))[1])


def inside(fqn: str, parent: str) -> bool:
    """``fqn`` is ``parent`` or under it (everything is under the root, ``""``)."""
    return not parent or fqn == parent or fqn.startswith(f"{parent}.")


def _top_k(graph: OpGraph, layer: str, experts: int) -> int:
    """The k of the ``topk`` in the layer's code (``topk(x, k)``, ``x.topk(k)``, ``k=``) that
    picks among the E experts (its input's last dim is E): DeepSeek-V3's gate first takes a
    top-k of expert groups; else the first ``topk``; 1 without one."""
    found = []
    for op in graph.ops:
        if op.kind == "function" and op.target == "topk" and inside(op.owner, layer):
            k = op.node.kwargs.get("k", op.node.args[1] if len(op.node.args) > 1 else None)
            if isinstance(k, int):
                found.append((bool(op.inputs) and graph.values[op.inputs[0]].shape[-1:] == (experts,), k))
    return next((k for over_experts, k in found if over_experts), found[0][1] if found else 1)


def _every_token(graph: OpGraph, op, shapes: list[tuple], dtypes: list, experts: int) -> bool:
    """A bank called on one [E T, H] tensor, expert-major: Llama 4's, every token once per
    expert, pre-scaled by its routing score (zero where not chosen). T is the rows of the
    layer's router (a matmul of E outputs before the bank), so a shared expert written as a
    bank and called on the tokens is not one."""
    if experts < 2 or len(shapes) != 1 or len(shapes[0]) != 2 or not dtypes[0].is_floating_point:
        return False
    layer = op.target.rpartition(".")[0]
    return any(routes(r, graph, layer, experts) and experts * _router_rows(graph, r) == shapes[0][0]
               for r in graph.ops[:op.index] if r.output is not None)


def _router_rows(graph: OpGraph, router) -> int:
    """The rows a router scores: its input's (a router module's output is its choice, not E scores)."""
    return math.prod(graph.values[router.inputs[0] if router.inputs else router.output].shape[:-1])


def expert_count(graph: OpGraph) -> int | None:
    """The experts of the model's routed banks (the fewest, if they differ); None without any."""
    return min((b.experts for b in routed_banks(graph) + listed_banks(graph)), default=None)
