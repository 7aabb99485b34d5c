"""Styles: the ``ParallelStyle`` subclasses shardplan adds to torch's.

Contract
--------
Each class here is a ``torch.distributed.tensor.parallel.style.ParallelStyle`` that
``parallelize_module`` applies like torch's own (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``), for what torch's set lacks:

* ``ReplicateParallel``: parameters become ``Replicate`` DTensors, activations stay plain,
  so optimizers' foreach kernels never mix DTensor and plain parameters;
* ``packed_placement``: the placement of a fused projection (``[gate; up]``) split so each
  rank keeps its slice of every part, whose global view is the module's own row order, so
  checkpoints and full state dicts reshard without loss (its style, ``PackedColwise``, in
  :mod:`.packed_colwise`);
* ``Conv1DColwise``/``Conv1DRowwise``: Hugging Face's ``Conv1D``, which stores ``W`` as
  ``[in, out]`` (the transpose of ``nn.Linear``'s), so each split is on the other dim;
* ``MoEExpertsParallel``: tensor parallel inside every expert of a 3-D expert bank (up and
  gate on their output features, down on its input features) with one all-reduce of the
  output forward; a packed up projection is placed by ``packed_placement``;
* heads shared across ranks (fewer kv heads than tp, MLA's shared key) in
  :mod:`.head_styles`;
* ``LocalVocabParallel``: the vocab-parallel embedding on local tensors, for an Embedding
  subclass whose own forward reads ``self.weight.to_local()`` or calls ``F.embedding``;
* ``ContainerParams``, ``CopyOutput``, ``Both``: a module's own parameters beside styled
  children, a copy of an output that is modified in place downstream, two styles on one module.

``placement("Shard(1)")`` turns the plan's layout strings into upstream placements.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from .packed import PackedShard

__all__ = [
    "placement", "ReplicateParallel", "Conv1DColwise", "Conv1DRowwise", "MoEExpertsParallel",
    "packed_placement", "ContainerParams", "CopyOutput", "Both", "combine", "LocalVocabParallel",
]


def placement(text: str | None, default: Any = None) -> Any:
    """``"Shard(1)"`` -> ``Shard(1)``; the plan's layout strings are upstream's spelling."""
    if text is None:
        return default
    if text == "Replicate":
        return Replicate()
    if text == "Partial":
        return Partial()
    m = re.fullmatch(r"Shard\((-?\d+)\)", text)
    if not m:
        raise ValueError(f"layout {text!r} is not Replicate, Partial or Shard(d)")
    return Shard(int(m.group(1)))


def runs_on_local_tensors(module: nn.Module) -> bool:
    """Replicated, ``module`` runs on plain inputs and its parameters' local tensors: a class
    with a forward of its own may not run on DTensors; nn.MultiheadAttention takes its masks
    as keyword arguments, which would stay plain beside DTensor inputs; a parametrization
    (weight_norm's g and v) computes its weight with ops DTensor has no backward rule for
    (``_weight_norm_interface_backward``)."""
    return (isinstance(module, nn.MultiheadAttention) or not type(module).forward.__module__.startswith("torch.nn.")
            or type(module).__module__ == "torch.nn.utils.parametrize")


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; inputs and outputs stay plain tensors.

    Keeps every parameter of a TP model a DTensor (optimizers' foreach kernels cannot mix
    DTensor and plain tensors) without changing the math: a replicated module on replicated
    inputs computes the same thing on every rank, and its gradients need no collective.
    """

    def __init__(self, *, output_layouts: Any = None, local: bool = False, partial_grads: bool = False) -> None:
        super().__init__()
        self.local = local or partial_grads  # run on plain inputs and local parameters, whatever the class
        # its input's gradient comes back Partial (MLA's kv_a_layernorm, on the shared key's
        # path): so do its parameters', all-reduced when backward ends (gradsync)
        self.partial_grads = partial_grads
        # Shard(d): hand on this rank's slice of the (replicated) output, as a position
        # embedding beside sequence-sharded tokens; Replicate -> Shard is a local slice
        # forward and an all-gather of the gradient backward
        self.output_layouts = output_layouts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layout = self.output_layouts
        if self.local or runs_on_local_tensors(module):
            return self._apply_local(module, device_mesh)

        def to_shard(_module, outputs, mesh):  # distribute_module wants exactly 3 arguments
            return outputs.redistribute(mesh, [layout]).to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, None, _inputs_to_replicate, _outputs_to_local if layout is None else to_shard)

    def _apply_local(self, module: nn.Module, device_mesh) -> nn.Module:
        """A class with its own ``forward`` (torchtitan's Embedding reads
        ``self.weight.to_local()``) may not run on DTensors: it runs on plain inputs and the
        parameters' local tensors, which, replicated, are the whole parameters."""
        # nn.MultiheadAttention's call reads its out_proj's parameters too
        names = [n for n, _ in module.named_parameters(recurse=isinstance(module, nn.MultiheadAttention))]
        own = ContainerParams(names, partial_grads=names if self.partial_grads else ())
        own.src_data_rank = self.src_data_rank
        own._apply(module, device_mesh)
        if self.output_layouts is not None:
            layout = self.output_layouts
            module.register_forward_hook(lambda _m, _i, out: DTensor.from_local(
                out, device_mesh, [Replicate()], run_check=False).redistribute(device_mesh, [layout]).to_local())
        return module


def _inputs_to_replicate(module, inputs, device_mesh):
    return tuple(
        DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
        for x in inputs
    )


def _outputs_to_local(module, outputs, device_mesh):
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for Hugging Face's Conv1D, whose weight is [in, out]: split dim 1."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, _conv1d_partition(Shard(1), Shard(0), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for Conv1D: the weight's input rows are dim 0; the bias stays whole."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # the contraction dim, as for nn.Linear
        return distribute_module(
            module, device_mesh, _conv1d_partition(Shard(0), Replicate(), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _conv1d_partition(weight: Any, bias: Any, src_data_rank: int | None):
    def partition(name, module, device_mesh):
        for pname, layout in (("weight", weight), ("bias", bias)):
            param = getattr(module, pname, None)
            if param is not None:
                dist = distribute_tensor(param, device_mesh, [layout], src_data_rank=src_data_rank)
                module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    return partition


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (Megatron's "f")."""

    @staticmethod
    def forward(ctx, x, group_name: str):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum the experts' partial outputs); identity backward ("g")."""

    @staticmethod
    def forward(ctx, x, group_name: str):
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_reduce(t: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(t.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class MoEExpertsParallel(ParallelStyle):
    """Tensor parallel inside every expert of a 3-D expert bank (``moe_tp_experts``).

    The up projection [E, X, H] is split on X, the down projection [E, H, I] on I (or the
    bmm layout [E, H, X] / [E, I, H] on the same features), as Megatron splits one MLP: up
    colwise, down rowwise. When X is gate and up packed as [gate; up] (X = 2I, split by
    ``chunk(2)``), each rank keeps matching slices of both halves (``packed_placement``,
    whose global view is the module's own [gate; up]); packed interleaved, [g0, u0, g1, u1]
    (gpt-oss), a plain Shard already keeps whole pairs on each rank. An up bias [E, X] is
    split as X is. The parameters are DTensors; the forward runs on their local shards and
    sums the partial outputs with one all-reduce, and the gradients of the inputs it consumed
    whole are all-reduced in backward. A down bias [E, H] is added after the down projection,
    inside the sum: each rank adds bias / tp, so the sum adds it once, and its gradient (the
    same on every rank, the sum's backward being the identity) is the one-process gradient.
    ``reduce_output=False`` (``output_layouts: Partial``) hands the partial sums on as they
    are, for the MoE block's return to reduce-scatter onto sequence shards.
    ``sequence_dim=d`` (``input_layouts``/``output_layouts: Shard(d)``): a bank that takes
    the tokens as ``[b, s, h]`` itself (its router inside) under sequence parallel, as
    Megatron's MLP does: the sequence shards all-gathered on entry (their gradient
    reduce-scattered back, which also sums each rank's share) and the partial sums
    reduce-scattered onto them where it returns (their gradient all-gathered).
    """

    def __init__(self, *, reduce_output: bool = True, sequence_dim: int | None = None) -> None:
        super().__init__()
        self.reduce_output = reduce_output
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from ..analyze.graph import expert_params
        from ..analyze.trace import bank_with_router

        ep = expert_params(module)
        # a router inside the bank runs whole: Replicate, its gradient each rank's share (Partial)
        router = bank_with_router(module) or []
        split = expert_tp_placements(module) + [(name, Replicate()) for name in router]
        for name, where in split:
            owner, leaf = _owner(module, name)
            param = distribute_tensor(getattr(owner, leaf).detach(), device_mesh, [where], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(param, requires_grad=getattr(owner, leaf).requires_grad))
        names = tuple(name for name, _ in split if name != ep.down_bias)
        group = device_mesh.get_group().group_name
        seq = (device_mesh, self.sequence_dim) if self.sequence_dim is not None else None
        enter = partial(_experts_enter, names=names, group=group, once=ep.down_bias, tp=device_mesh.size(),
                        partial_grads=tuple(router), seq=seq)
        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(partial(_experts_leave, group=group if self.reduce_output else None, seq=seq))
        return module


def expert_tp_placements(module: nn.Module) -> list[tuple[str, Any]]:
    """Each parameter of an expert bank and its placement on the tp axis (the class doc)."""
    from ..analyze.graph import expert_params

    ep = expert_params(module)
    # a packed up projection [gate; up] keeps [gate_r; up_r] on rank r (packed_placement)
    up_placement = packed_placement(parts=2, dim=ep.up_dim) if ep.packed and not ep.interleaved else Shard(ep.up_dim)
    split = [(ep.up, up_placement), (ep.down, Shard(ep.down_dim))]
    split += [(ep.gate, Shard(ep.up_dim))] if ep.gate else []  # a gate splits as up does
    split += [(ep.up_bias, _bias_placement(up_placement))] if ep.up_bias else []
    split += [(ep.down_bias, Replicate())] if ep.down_bias else []
    return split


def _bias_placement(weight: Any) -> Any:
    """The up bias [E, X] is cut as the weight's X dim is, which is dim 1 of the bias."""
    if isinstance(weight, _StridedShard):
        return _StridedShard(1, split_factor=weight.split_factor)
    return Shard(1)


class _ScaleForward(torch.autograd.Function):
    """``x * scale`` forward, identity backward: a term every rank adds to a partial sum
    (bias / tp each, summed once by the all-reduce) whose gradient is the full gradient."""

    @staticmethod
    def forward(ctx, x, scale: float):
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def packed_placement(*, parts: int | Sequence[int], dim: int) -> _StridedShard:
    """The placement of a weight packing ``parts`` projections along ``dim`` ([gate; up]):
    split into its parts first, then each part into tp chunks, rank r keeping
    [gate_r; up_r], so the chunks a downstream ``chunk(parts)`` takes locally are each
    part's own shard. In DTensor's terms that is a right-to-left sharding, ``_StridedShard``
    with ``split_factor=parts``: the global view stays the module's own [gate; up] at every
    tp, so ``full_tensor()``, DCP (resharding to another tp) and full state dicts see the
    weight as the unsharded model has it (DCP needs :mod:`.state`'s chunk methods for it).

    ``parts`` a list of relative widths ([4, 1, 1]: a GQA [Q; K; V] of 8 q heads and 2 kv
    heads) cuts unequal parts: :class:`.packed.PackedShard` (equal widths are the int form)."""
    from .state import _install_dcp_chunks

    _install_dcp_chunks()
    if isinstance(parts, int):
        return _StridedShard(dim, split_factor=parts)
    parts = tuple(parts)
    if len(set(parts)) == 1:  # [2, 2]: equal parts
        return _StridedShard(dim, split_factor=len(parts))
    return PackedShard(dim, parts=parts)


def _experts_enter(module, args, kwargs, *, names, group, once, tp, partial_grads=(), seq=None):
    # run on local shards; to_local is differentiable, so gradients reach the DTensor params
    _swap_to_local(module, args, names=names, partial_grads=partial_grads)
    if once:  # the down bias: bias / tp on each rank, so the all-reduce adds it once
        module._shardplan_params[once] = module._parameters[once]
        module._parameters[once] = _ScaleForward.apply(module._parameters[once].to_local(), 1.0 / tp)
    if seq is not None:  # Shard(d) -> Replicate: all-gather; its backward reduce-scatters the Partial gradient
        mesh, dim = seq
        return (DTensor.from_local(args[0], mesh, [Shard(dim)], run_check=False).redistribute(mesh, [Replicate()])
                .to_local(grad_placements=[Partial()]), *args[1:]), kwargs
    wrap = lambda x: _CopyToTP.apply(x, group) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad else x  # noqa: E731
    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


def _experts_leave(module, args, output, *, group, seq=None):
    _restore_params(module, args, output)
    if seq is not None:  # Partial -> Shard(d): reduce-scatter; its backward all-gathers the gradient
        mesh, dim = seq
        return DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(dim)]).to_local()
    return _ReduceFromTP.apply(output, group) if group is not None else output


class ContainerParams(ParallelStyle):
    """A module that owns parameters and also has weight-bearing children (ViT's embeddings
    own ``cls_token``; a Mamba mixer reads ``self.conv1d.weight`` without calling conv1d):
    those parameters (``paths``, relative to the module) become Replicate DTensors, so foreach
    optimizers see one kind of tensor, and its forward sees their local tensors, since its
    other inputs are plain. ``to_local`` is differentiable: gradients reach the DTensors."""

    def __init__(self, paths: list[str], *, placements: dict[str, Any] | None = None,
                 partial_grads: list[str] = ()) -> None:
        super().__init__()
        self.paths = paths
        # a per-head parameter beside heads split tp ways (gpt-oss's sinks): Shard(d), so the
        # forward reads its heads' entries; its gradient is local to them
        self.placements = placements or {}
        # a whole parameter read by a computation split tp ways (a temperature times scores
        # split by heads): each rank's gradient sums its own shard only, so it is declared
        # Partial and all-reduced when backward ends (gradsync)
        self.partial_grads = tuple(partial_grads)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _distribute_own(module, self.paths, self.placements, device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(partial(_swap_to_local, names=self.paths, partial_grads=self.partial_grads))
        module.register_forward_hook(_restore_params)
        return module


def _distribute_own(module: nn.Module, paths: list[str], placements: dict[str, Any], mesh, src_data_rank) -> None:
    """The parameters ``paths`` (relative to ``module``) as DTensors, Replicate unless
    ``placements`` says otherwise."""
    for path in paths:
        owner, name = _owner(module, path)
        p = owner._parameters[name]
        if not isinstance(p, DTensor):
            dist = distribute_tensor(p.detach(), mesh, [placements.get(path, Replicate())], src_data_rank=src_data_rank)
            owner.register_parameter(name, nn.Parameter(dist, requires_grad=p.requires_grad))


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), name


def _swap_to_local(module, args, *, names, partial_grads=()):
    module._shardplan_params = {}
    for path in names:
        owner, name = _owner(module, path)
        param = owner._parameters[name]
        if not isinstance(param, DTensor):  # already local: the whole forward reads it so
            continue
        module._shardplan_params[path] = param
        # Partial where the parameter is replicated: each rank's gradient is its own share
        grads = tuple(Partial() if p.is_replicate() else p for p in param.placements) if path in partial_grads else None
        owner._parameters[name] = param.to_local(grad_placements=grads)


def local_during_forward(model: nn.Module, paths: list[str]) -> None:
    """The parameters ``paths`` are their local tensors for the whole of ``model``'s forward:
    code that is not a module (a tied head as a plain object) reads them beside plain
    activations. ``to_local`` is differentiable, so gradients reach the DTensors."""
    state: dict[str, Any] = {}

    def swap(module, args):
        for path in paths:
            try:
                owner, name = _owner(module, path)
            except AttributeError:  # a module above it stood in for by the local check
                continue
            # not already swapped by its own style (or gone: the local check stood its module in)
            if isinstance(owner._parameters.get(name), DTensor):
                state[path] = owner._parameters[name]
                owner._parameters[name] = state[path].to_local()

    def restore(module, args, output):
        for path, param in state.items():
            owner, name = _owner(module, path)
            owner._parameters[name] = param
        state.clear()

    model.register_forward_pre_hook(swap)
    model.register_forward_hook(restore)


def _restore_params(module, args, output):
    for path, param in module._shardplan_params.items():
        owner, name = _owner(module, path)
        owner._parameters[name] = param
    del module._shardplan_params


class LocalVocabParallel(ParallelStyle):
    """Vocab-parallel embedding computed on local tensors. torch's ``RowwiseParallel`` hands an
    Embedding a DTensor input beside a DTensor weight; a subclass whose forward takes the
    weight's local tensor (``self.weight.to_local()``, torchtitan's) or passes its weight to
    ``F.embedding`` with the plain ids then mixes the two. Here rank r holds rows
    [r*c, r*c + n_r) of the table (``Shard(0)``, c = ceil(V / tp)); the module's own forward runs
    on the local rows with plain tensors, and in the ``F.embedding`` call it makes on them each
    id is shifted into that range (ids of other ranks point at row 0) and the rows this rank
    does not hold are zeroed. The sum over ranks is
    the lookup (Partial): to Replicate is an all-reduce, to Shard(1) (sequence parallel) a
    reduce-scatter, the same collectives as torch's style."""

    def __init__(self, *, output_layouts: Any = None) -> None:
        super().__init__()
        self.output_layouts = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _distribute_own(module, ["weight"], {"weight": Shard(0)}, device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(partial(_vocab_enter, mesh=device_mesh))
        module.register_forward_hook(partial(_vocab_leave, mesh=device_mesh, layout=self.output_layouts))
        return module


def _vocab_enter(module, args, *, mesh):
    table = module._parameters["weight"]
    rows = -(-table.shape[0] // mesh.size())
    local = table.to_local()
    lookup = _LocalLookup(local, offset=mesh.get_local_rank() * rows)
    # the lookup is found inside forward, not at its arguments: a subclass may derive the ids
    # it looks up from its input (FSMT's sinusoidal positions count non-padding tokens) or
    # scale the rows it got (Gemma's, BART's scaled embeddings)
    lookup.__enter__()
    module._shardplan_vocab = (table, lookup)
    module._parameters["weight"] = local
    return args


def _vocab_leave(module, args, output, *, mesh, layout):
    table, lookup = module._shardplan_vocab
    lookup.__exit__(None, None, None)
    del module._shardplan_vocab
    module._parameters["weight"] = table
    if lookup.mine is None:
        raise RuntimeError(f"{type(module).__name__}: its forward never looked up its weight with F.embedding; "
                           "vocab-parallel cannot shard it (plan it replicated)")
    return DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(mesh, [layout]).to_local()


class _LocalLookup(TorchFunctionMode):
    """``F.embedding`` on this rank's rows: ids in [offset, offset + n) are shifted to local
    rows, the others read row 0 and are zeroed, so the sum over ranks is the lookup. What the
    forward does to the rows after (a scale) is linear, so its output is a Partial sum too."""

    def __init__(self, local: torch.Tensor, *, offset: int) -> None:
        super().__init__()
        self.local, self.offset, self.mine = local, offset, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if func is not F.embedding or weight is not self.local:
            return func(*args, **kwargs)
        ids = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        rows = self.local.shape[0]
        mine = (ids >= self.offset) & (ids < self.offset + rows)
        padding = args[2] if len(args) > 2 else kwargs.get("padding_idx")
        rest = {k: v for k, v in kwargs.items() if k not in ("input", "weight", "padding_idx")}
        # the padding row's index among this rank's rows, if it holds it (no gradient there)
        out = F.embedding(torch.where(mine, ids - self.offset, torch.zeros_like(ids)), self.local,
                          _local_padding(padding, self.offset, rows), *args[3:], **rest)
        self.mine = mine
        return out * mine.unsqueeze(-1).to(out.dtype)


def _local_padding(padding: int | None, offset: int, rows: int) -> int | None:
    return padding - offset if padding is not None and offset <= padding < offset + rows else None


class SharedInput(PrepareModuleInput):
    """``PrepareModuleInput`` for a region whose value the module receives in more than one
    slot (torchtune's ``self.attn(h, h, mask=...)``: x for q, y for k and v; fairseq's
    ``self_attn(query=x, key=x, value=x)``): every slot
    holding that same tensor gets the one DTensor, so the Partial gradients of q, k and v
    add up there and one all-reduce closes the region, not one per slot."""

    def _prepare_input_fn(self, inputs, device_mesh):
        raw = inputs if isinstance(inputs, tuple) else (inputs,)
        prepared = super()._prepare_input_fn(inputs, device_mesh)
        converted = _converted(raw, prepared, self.input_layouts)
        return tuple(converted.get(id(a), p) for a, p in zip(raw, prepared))

    def _prepare_input_kwarg_fn(self, inputs, kwarg_inputs, device_mesh):
        args, kwargs = super()._prepare_input_kwarg_fn(inputs, kwarg_inputs, device_mesh)
        raw = inputs if isinstance(inputs, tuple) else (inputs,)
        converted = _converted(raw, args, self.input_layouts)
        # a keyword slot too (fairseq's ``self_attn(query=x, key=x, value=x)``)
        named = list(self.input_kwarg_layouts or {})
        converted.update(_converted(tuple(kwarg_inputs.get(k) for k in named), tuple(kwargs.get(k) for k in named),
                                    [self.input_kwarg_layouts[k] for k in named]))
        return (tuple(converted.get(id(a), p) for a, p in zip(raw, args)),
                {k: converted.get(id(v), kwargs[k]) for k, v in kwarg_inputs.items()})


def _converted(raw: tuple, prepared: tuple, layouts) -> dict[int, Any]:
    """id of each tensor a slot with a layout held -> what that slot was prepared into."""
    return {id(a): p for a, p, lay in zip(raw, prepared, layouts or ()) if lay is not None and isinstance(a, torch.Tensor)}


class CopyOutput(ParallelStyle):
    """Hand on a copy of the output: downstream code modifies it in place, which autograd
    forbids on the local view ``DTensor.to_local`` returns."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _i, out: out.clone() if isinstance(out, torch.Tensor) else out)
        return module


class AsLinear(ParallelStyle):
    """A Linear written by hand (``analyze.graph.linear_like``: own ``weight`` [out, in],
    ``F.linear`` in its forward) under a Linear style. torch's Colwise/RowwiseParallel refuse
    any class but ``nn.Linear`` before partitioning ``weight`` and ``bias`` exactly as they
    would an ``nn.Linear``'s, so the module is an ``nn.Linear`` subclass while ``style``
    applies (its own class first, so its ``forward`` runs), then its own class again: the
    hooks the style installed stay on the instance."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        cls = type(module)
        module.__class__ = type(cls.__name__, (cls, nn.Linear), {"extra_repr": cls.extra_repr})
        try:
            return self.style._apply(module, device_mesh)
        finally:
            module.__class__ = cls


class Both(ParallelStyle):
    """Two styles on one module (a block's entry and exit), applied in order."""

    def __init__(self, first: ParallelStyle, second: ParallelStyle) -> None:
        self.first, self.second = first, second

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return self.second._apply(self.first._apply(module, device_mesh), device_mesh)


def combine(existing: ParallelStyle | None, new: ParallelStyle) -> ParallelStyle:
    return new if existing is None else Both(existing, new)
