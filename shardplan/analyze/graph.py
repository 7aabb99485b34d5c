"""Graph: the traced fx graph reduced to what the planner reasons about.

Contract
--------
``build_graph(traced)`` returns an :class:`OpGraph`: every fx node becomes an :class:`Op`
with the ids of the tensor values it consumes and the value it produces (global shapes,
bytes). Ops carry their *kind* (input, const, weight module, folded block, function,
output), the module FQN that owns them, and a *multiplicity*: how many times the op runs
per forward once folded repeated blocks are counted (ops inside ``layers.0`` of a
32-layer model run 32 times).

``weight_graph(graph)`` is the ``networkx.DiGraph`` users look at: nodes are weight-bearing
module FQNs, an edge ``a -> b`` means ``a``'s output reaches ``b``'s input through ops
that hold no weights. Nothing here depends on module *names*: only on data flow.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from .trace import Traced, is_weight_leaf, listed_heads

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Value", "Op", "OpGraph", "build_graph", "weight_graph", "module_kind", "linear_like", "router_like", "grad_inputs", "EXPERT_CONTAINERS", "LIKE_OPS", "rows_width", "same_data", "writes"]


@dataclass(frozen=True)
class Value:
    id: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    producer: int  # op index


@dataclass
class Op:
    index: int
    node: torch.fx.Node
    kind: str  # "input" | "const" | "module" | "folded" | "function" | "output"
    target: str  # function/method name, or module FQN for module/folded ops
    owner: str  # FQN of the innermost module the op runs in ("" = top level)
    inputs: list[int]  # value ids, in argument order, tensors only
    output: int | None  # value id (tensor or tuple of tensors), None for non-tensors
    multiplicity: int = 1
    module_kind: str = ""  # for "module" ops: "linear" | "embedding" | "norm" | "other"


@dataclass
class OpGraph:
    traced: Traced
    ops: list[Op]
    values: dict[int, Value]
    consumers: dict[int, list[int]] = field(default_factory=dict)
    # module FQN -> number of times it runs per forward (folded repeats included)
    module_multiplicity: dict[str, int] = field(default_factory=dict)
    # values whose gradient autograd computes (downstream of a trainable weight)
    requires_grad: set[int] = field(default_factory=set)
    # values a gradient reaches from the output: floating (or complex) values with a path of
    # such values to it (an argmax's input is not one: the argmax's integers end the path)
    grad_reaches: set[int] = field(default_factory=set)
    # (tp, options) -> op index -> strategies: explain re-solves the same graph many times
    strategy_cache: dict = field(default_factory=dict)

    def op_of(self, node: torch.fx.Node) -> Op:
        return self.ops[node.meta["shardplan_op"]]

    def value_of(self, node: torch.fx.Node) -> Value | None:
        op = self.op_of(node)
        return self.values.get(op.output) if op.output is not None else None

    @property
    def model(self) -> nn.Module:
        return self.traced.model


def module_kind(module: nn.Module) -> str:
    """Classify a weight-owning module by its parameters' roles, not its name."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    if listed_heads(module) is not None:
        return "listed_heads"
    if isinstance(module, nn.Linear) and weight is not None and weight.dim() == 2:
        return "linear"
    if linear_like(module):
        return "linear"
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2 and hasattr(module, "nf"):
        return "conv1d"  # Hugging Face's transposed Linear (GPT-2): y = x @ W + b, W [in, out]
    if isinstance(module, nn.Embedding):
        return "embedding"
    if params and all(p.dim() == 1 for p in params.values()) and _is_norm_like(module, params):
        return "norm"
    if expert_params(module) is not None:
        return "experts"
    return "other"


@dataclass(frozen=True)
class ExpertParams:
    """A bank of expert MLPs stored as 3-D weights: which parameter is which, and the dim of
    each that holds the inner (intermediate) features, the one tensor parallelism splits."""

    up: str
    down: str
    packed: bool  # gate and up in one weight
    up_dim: int
    down_dim: int
    gate: str | None = None  # a separate gate weight shaped as ``up`` (torchtitan's w1 beside w3)
    # packed as [g0, u0, g1, u1, ...] (gpt-oss: gate_up[..., ::2]) instead of [gate; up]
    # (chunk(2)): a plain Shard keeps whole (gate_i, up_i) pairs together on each rank
    interleaved: bool = False
    up_bias: str | None = None  # [E, X]: split as up's features are
    down_bias: str | None = None  # [E, H]: added once after the experts' partial sums


def expert_params(module: nn.Module) -> ExpertParams | None:
    """Recognized by shapes alone, over the same E experts: up [E, X, H] with down [E, H, I]
    (F.linear layout), or up [E, H, X] with down [E, I, H] (bmm layout, Llama 4, gpt-oss),
    where X == I, or X == 2*I for gate and up packed; or three weights, gate and up of one
    shape and down its transpose (torchtitan's GroupedExperts: w1, w3 [E, I, H], w2 [E, H, I]).
    Optional 2-D biases [E, X] and [E, H] (gpt-oss) belong to up and down by shape, or by
    name prefix where the shapes agree."""
    params = {n: p for n, p in module.named_parameters(recurse=False)}
    weights = {n: p for n, p in params.items() if p.dim() == 3}
    biases = {n: p for n, p in params.items() if p.dim() == 2}
    if len(weights) not in (2, 3) or len(weights) + len(biases) != len(params) or len(biases) > 2:
        return None
    if len(weights) == 3:
        found = _three_weight_bank(weights)
    else:
        (a, pa), (b, pb) = weights.items()
        readings = _readings(a, pa, b, pb) + _readings(b, pb, a, pa)
        hint = _hidden_hint(module)
        # [E, A, B] + [E, B, A] reads four ways by shape alone: the width the module's own
        # router takes (or its hidden_dim) says which dim is the tokens' width; a square bank
        # (A == B) still reads two ways, and its code says which: ``x @ w[e]`` the bmm layout
        fitting = [r for r in readings if hint is not None and weights[r.up].shape[3 - r.up_dim] == hint] or readings
        if len(fitting) > 1 and _bmm_in_source(type(module)):
            fitting = [r for r in fitting if r.up_dim == 2] or fitting
        found = fitting[0] if fitting else None
    if found is None:
        return None
    found = replace(found, interleaved=found.packed and _interleaved(module))
    return _with_biases(found, weights, biases) if biases else found


# containers a layer may hold its experts in, each expert a module (``experts[i]``,
# ``experts[str(i)]``, ``for expert in experts``)
EXPERT_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def rows_width(expert: nn.Module) -> int | None:
    """H, the width of the rows an expert module takes: its first Linear's ``in_features``;
    None for an expert with no Linear (raw parameters)."""
    first = next((m for m in expert.modules() if isinstance(getattr(m, "in_features", None), int)), None)
    return None if first is None else first.in_features


def linear_like(module: nn.Module) -> bool:
    """A Linear written by hand: not an ``nn.Linear``, it owns ``weight`` [out, in] (and a
    ``bias`` [out]) and nothing else, and its ``forward`` computes ``F.linear(x, self.weight,
    ...)`` or ``x @ self.weight.T`` (DeepSeek's and gemma's reference code write one to
    control init and dtype), and no top-k (a router). It splits as nn.Linear does."""
    if isinstance(module, (nn.Linear, nn.Embedding)) or any(True for _ in module.children()):
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.dim() != 2 or set(params) - {"weight", "bias"}:
        return False
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return False
    return _linear_in_source(type(module))


@functools.lru_cache(maxsize=256)
def _linear_in_source(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    # a router (Mixtral's MixtralTopKRouter: F.linear, then top-k) is more than a Linear; its
    # few rows stay whole, as Megatron keeps them
    return "topk" not in source and re.search(
        r"linear\([^,()]+(\([^()]*\))?[^,()]*,\s*self\.weight\b|@\s*self\.weight\.(T\b|t\(\))", source) is not None


def router_like(module: nn.Module) -> bool:
    """An MoE router written as a module of its own (Mixtral's ``MixtralTopKRouter``: a
    ``weight`` [experts, hidden] and a top-k in its class): whole on every rank by design, as
    Megatron, torchtitan and Hugging Face keep routers, not a weight left unsplit."""
    weight = getattr(module, "weight", None)
    return (not isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and _topk_in_source(type(module)))


@functools.lru_cache(maxsize=256)
def _class_source(cls: type) -> str:
    """Per class: reading its source costs ~25 ms, once per layer otherwise; "" where none."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _topk_in_source(cls: type) -> bool:
    return "topk" in _class_source(cls)


def _interleaved(module: nn.Module) -> bool:
    """Hugging Face declares it (``use_experts_implementation(is_concatenated=False)``);
    other code shows it by taking the gate as a stride-2 slice (``x[..., ::2]``)."""
    declared = getattr(module, "is_concatenated", None)
    if isinstance(declared, bool):
        return not declared
    return _strided_gate_in_source(type(module))


def _strided_gate_in_source(cls: type) -> bool:
    return re.search(r"\[\s*\.\.\.\s*,\s*0?\s*::\s*2\s*\]", _class_source(cls)) is not None


def _with_biases(ep: ExpertParams, weights: dict, biases: dict) -> ExpertParams | None:
    up_w, down_w = weights[ep.up], weights[ep.down]
    num_up = up_w.shape[ep.up_dim]
    hidden = down_w.shape[3 - ep.down_dim]
    roles: dict[str, str] = {}
    for name, b in biases.items():
        if b.shape[0] != up_w.shape[0]:
            return None
        by_name = "up" if name.startswith(ep.up) else "down" if name.startswith(ep.down) else None
        by_shape = {"up"} if b.shape[1] == num_up else set()
        by_shape |= {"down"} if b.shape[1] == hidden else set()
        role = by_name if by_name in by_shape else next(iter(by_shape)) if len(by_shape) == 1 else None
        if role is None or role in roles.values():
            return None  # a 2-D parameter that is neither bias: not a bank this knows
        roles[name] = role
    named = {role: name for name, role in roles.items()}
    return replace(ep, up_bias=named.get("up"), down_bias=named.get("down"))


def _up_down(up: str, pu: torch.Tensor, down: str, pd: torch.Tensor, gate: str | None = None) -> ExpertParams | None:
    found = _readings(up, pu, down, pd, gate)
    return found[0] if found else None


def _readings(up: str, pu: torch.Tensor, down: str, pd: torch.Tensor, gate: str | None = None) -> list[ExpertParams]:
    """``up`` and ``down`` read as the F.linear layout, the bmm layout, or both (square)."""
    if pu.shape[0] != pd.shape[0]:
        return []
    packable = gate is None  # a separate gate means up is not packed
    found = []
    if pd.shape[1] == pu.shape[2] and (pu.shape[1] == pd.shape[2] or packable and pu.shape[1] == 2 * pd.shape[2]):
        found.append(ExpertParams(up, down, pu.shape[1] == 2 * pd.shape[2], 1, 2, gate))
    if pd.shape[2] == pu.shape[1] and (pu.shape[2] == pd.shape[1] or packable and pu.shape[2] == 2 * pd.shape[1]):
        found.append(ExpertParams(up, down, pu.shape[2] == 2 * pd.shape[1], 2, 1, gate))
    return found


def _bmm_in_source(cls: type) -> bool:
    """The class multiplies its weights as ``x @ w`` (bmm, matmul), not ``F.linear(x, w)``."""
    source = _class_source(cls)
    return "linear(" not in source and any(t in source for t in (" @ ", "matmul(", "bmm("))


def _hidden_hint(module: nn.Module) -> int | None:
    """The tokens' width as the module says it: its router's ``in_features`` (a bank with its
    router inside), else an int ``hidden_dim``/``hidden_size`` attribute (Hugging Face's banks)."""
    router = next((m for m in module.children() if isinstance(m, nn.Linear)), None)
    if router is not None:
        return router.in_features
    value = next((getattr(module, n) for n in ("hidden_dim", "hidden_size", "dim") if hasattr(module, n)), None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _three_weight_bank(params: dict[str, torch.Tensor]) -> ExpertParams | None:
    """The two weights of one shape are gate and up (in declaration order), the third down."""
    names = list(params)
    for down in names:
        gate, up = (n for n in names if n != down)
        if params[gate].shape == params[up].shape:
            found = _up_down(up, params[up], down, params[down], gate=gate)
            if found is not None:
                return found
    return None


def _is_norm_like(module: nn.Module, params: dict[str, torch.Tensor]) -> bool:
    # 1-D parameters that all have one size (weight and optional bias over the last dim)
    sizes = {p.shape[0] for p in params.values()}
    return len(sizes) == 1 and not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))


def _tensor_nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_tensor_nbytes(v) for v in val)
    return 0


def _first_tensor(val: Any) -> torch.Tensor | None:
    if isinstance(val, torch.Tensor):
        return val
    if isinstance(val, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in val) if t is not None), None)
    return None


def _owner(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = next(reversed(stack.values()))[0]
    return fqn[2:] if fqn.startswith("m.") else ("" if fqn == "m" else fqn)


# ATen ops that are a Python op with the same arguments: ``x.split([q, k, v], dim)`` exports
# as ``split_with_sizes``
_ATEN_AS = {"split_with_sizes": "split"}


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "call_method", "placeholder", "output"):
        return str(node.target)
    target = node.target
    if target in (operator.getitem,):
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):  # torch.export's ATen ops: aten.view.default -> view
        name = target.overloadpacket.__name__
        return _ATEN_AS.get(name, name)
    return getattr(target, "__name__", str(target))


def _kind(node: torch.fx.Node, traced: Traced) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "const"
    if node.op == "output":
        return "output"
    if node.op == "call_module":
        if node.target in traced.folded:
            return "folded"
        if is_weight_leaf(traced.model.get_submodule(node.target)):
            return "module"
    return "function"


def _tensor_input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return [n for n in found if _first_tensor(n.meta.get("val")) is not None]


def build_graph(traced: Traced) -> OpGraph:
    ops: list[Op] = []
    values: dict[int, Value] = {}
    for index, node in enumerate(traced.graph.nodes):
        node.meta["shardplan_op"] = index
        val = node.meta.get("val")
        out = None
        first = _first_tensor(val)
        if first is not None and node.op != "output":
            out = index
            values[index] = Value(index, node.name, tuple(first.shape), first.dtype, _tensor_nbytes(val), index)
        inputs = [n.meta["shardplan_op"] for n in _tensor_input_nodes(node)]
        op = Op(index, node, _kind(node, traced), _target_name(node), _owner(node), inputs, out)
        if op.kind == "module":
            op.module_kind = module_kind(traced.model.get_submodule(node.target))
        ops.append(op)
    graph = OpGraph(traced, ops, values)
    for op in ops:
        for v in op.inputs:
            graph.consumers.setdefault(v, []).append(op.index)
    _set_multiplicity(graph)
    _set_requires_grad(graph)
    _set_grad_reaches(graph)
    return graph


def _trainable_attribute(model: nn.Module, target: str) -> bool:
    """A parameter read directly in forward (``x * self.scale``) is a const op that needs grad."""
    try:
        return model.get_parameter(target).requires_grad
    except (AttributeError, ValueError):
        return False


# ops whose result carries no gradient whatever their input: they read its dtype, device or
# shape only (``q.new_full((T, T), -inf)``, a mask made beside q), or cut the graph
_DATA_FREE = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "empty_like",
                        "full_like", "detach"})
# ``x.to(other)``, ``x.type_as(other)``: other gives its dtype and device only, no gradient
LIKE_OPS = frozenset({"to", "type_as"})


def grad_inputs(op: Op) -> list[int]:
    """The inputs of ``op`` a gradient flows back to (all but those read for metadata)."""
    if op.kind != "function":
        return op.inputs
    return [] if op.target in _DATA_FREE else op.inputs[:1] if op.target in LIKE_OPS else op.inputs


def same_data(graph: OpGraph, value: int, through: frozenset[str] = LIKE_OPS) -> list[int]:
    """``value`` and the values it shares its data with, back through the ops ``through``
    (``to``/``type_as``: Meta's ``self.cache_k = self.cache_k.to(xq)`` returns the cache itself)
    and slices whose index holds no tensor (litgpt's ``self.k[:n]``): a write into it writes
    into them. The last is where that data comes from (a model tensor's ``const``)."""
    found = [value]
    op = graph.ops[graph.values[value].producer]
    while op.kind == "function" and op.inputs and (op.target in through or (op.target == "getitem" and len(op.inputs) == 1)):
        found.append(op.inputs[0])
        op = graph.ops[graph.values[op.inputs[0]].producer]
    return found


def _set_requires_grad(graph: OpGraph) -> None:
    """Inputs and constants need no gradient; anything computed from a trainable weight does,
    unless the op carries none (data-free, or a result that is not floating point)."""
    # a call returning a tuple is one value typed by its first tensor: DeepSeek-V4's router
    # returns its integer indices first, so its float weights are judged where taken out
    tuples: set[int] = set()
    for op in graph.ops:
        if writes(op) and any(v in graph.requires_grad for v in op.inputs[1:]):
            # ``out[:, t] = y`` with y needing one (RWKV's zeros_like filled step by step): the
            # tensor written into needs a gradient from here on, for every reader after it
            graph.requires_grad.update(same_data(graph, op.inputs[0]))
        if op.output is None or (op.node is not None and op.node.meta.get("shardplan_no_grad")):
            continue  # (an op the model's own code runs under ``torch.no_grad()`` carries none)
        trainable = (op.kind in ("module", "folded") and any(
            p.requires_grad for p in graph.model.get_submodule(op.target).parameters()
        )) or (op.kind == "const" and _trainable_attribute(graph.model, op.target))
        carried = any(v in graph.requires_grad for v in grad_inputs(op)) or (
            op.target == "getitem" and op.inputs[:1] and op.inputs[0] in tuples)
        if (trainable or carried) and isinstance(op.node.meta.get("val") if op.node is not None else None, (tuple, list)):
            tuples.add(op.output)
        dtype = graph.values[op.output].dtype
        if (trainable or carried) and (dtype is None or dtype.is_floating_point or dtype.is_complex):
            graph.requires_grad.add(op.output)


def _set_grad_reaches(graph: OpGraph) -> None:
    """Backward from the output: an op's floating inputs get a gradient when its output does,
    or, for an op that writes into its first input (``out[rows] = y``, ``index_add_``), when
    that input does after it."""
    for op in reversed(graph.ops):
        if op.kind == "output" or (op.output is not None and op.output in graph.grad_reaches) or (
                writes(op) and op.inputs[0] in graph.grad_reaches):
            graph.grad_reaches.update(v for v in op.inputs if _differentiable(graph.values[v].dtype))


def writes(op: Op) -> bool:
    """``op`` writes into its first input (``out[rows] = y``, ``index_add_``, ``copy_``)."""
    return op.kind == "function" and (op.target == "setitem" or op.target.endswith("_")) and bool(op.inputs)


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex  # complex: RoPE's view_as_complex carries gradients


def _set_multiplicity(graph: OpGraph) -> None:
    """Ops inside a representative block run once per folded copy too."""
    copies: dict[str, int] = {}
    for rep in graph.traced.folded.values():
        copies[rep] = copies.get(rep, 1) + 1
    for op in graph.ops:
        mult = 1
        for rep, n in copies.items():
            if op.owner == rep or op.owner.startswith(rep + ".") or (op.kind == "module" and _inside(op.target, rep)):
                mult *= n
        op.multiplicity = mult
        if op.kind in ("module", "folded"):
            graph.module_multiplicity[op.target] = graph.module_multiplicity.get(op.target, 0) + mult


def _inside(fqn: str, prefix: str) -> bool:
    return fqn == prefix or fqn.startswith(prefix + ".")


def weight_graph(graph: OpGraph) -> nx.DiGraph:
    """Weight-bearing modules and which feed which through weight-free ops."""
    import networkx as nx  # only this view needs it: its import is a fifth of a second of every command

    g = nx.DiGraph()
    weight_ops = [op for op in graph.ops if op.kind in ("module", "folded")]
    for op in weight_ops:
        g.add_node(op.target, kind=op.module_kind or op.kind, shape=graph.values[op.output].shape if op.output is not None else ())
    for op in weight_ops:
        for reached in _reachable_weights(graph, op):
            g.add_edge(op.target, graph.ops[reached].target)
    return g


def _reachable_weights(graph: OpGraph, start: Op) -> set[int]:
    found: set[int] = set()
    stack = [start.output] if start.output is not None else []
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        for consumer in graph.consumers.get(value, []):
            op = graph.ops[consumer]
            if op.kind in ("module", "folded"):
                found.add(consumer)
            elif op.output is not None and op.output not in seen:
                seen.add(op.output)
                stack.append(op.output)
    return found
