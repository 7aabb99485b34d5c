"""Head styles: the ``ParallelStyle`` subclasses for heads shared across ranks.

Contract
--------
Like :mod:`.styles` (whose parameter helpers they use), each class is applied by
``parallelize_module``:

* ``ColwiseKVReplicated``: a k/v projection with fewer kv heads than tp: colwise on
  kv-head groups, each group replicated on the ranks whose query heads read it
  (``grouped_mesh``: the tp axis as ``(groups, tp / groups)``);
* ``ColwiseKVGathered``: the same kv-head groups from a weight split 1/tp, each group's
  head gathered across its ranks;
* ``GatherPartialGrad``, ``ReplicatePartialGrad``, ``ColwisePartialInput``: MLA's latent
  projection (gathered, or whole) and its reader, around a whole value whose gradient comes
  back Partial (the shared rotary key, broadcast to heads split tp ways);
* ``NormSharded``: a norm over features split tp ways (OLMo 2's q_norm over all heads) run
  on DTensors, its statistic all-reduced, its weight split with the features;
* ``FoldedSlice``: a whole input with the heads folded into the batch (Bloom's ALiBi,
  ``[b * heads, 1, keys]``), cut to this rank's heads of every batch row where the module
  receives it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from .mesh import kv_group_mesh, grouped_mesh
from .styles import Conv1DRowwise, _distribute_own, _restore_params, _swap_to_local

__all__ = ["grouped_mesh", "ColwiseKVReplicated", "ColwiseKVGathered", "GatherPartialGrad", "ReplicatePartialGrad", "ColwisePartialInput",
           "FoldedSlice", "NormSharded"]


class ColwiseKVReplicated(ParallelStyle):
    """``colwise_kv_replicated``: a k or v projection when tp exceeds the kv heads.

    Query head i reads kv head i // (heads / kv_heads); with heads split tp ways, rank r's
    query heads all read kv head r // (tp / groups). So the weight [kv_heads * head_dim, in]
    is placed ``[Shard(0), Replicate()]`` on the tp axis unflattened to (groups, tp /
    groups) (:func:`grouped_mesh`): each rank holds the rows of its kv head, and
    ``y = x W_local^T`` is that kv head's keys, with no collective. Backward, each rank
    back-propagates its own query heads' share only: the weight gradient is Partial over the
    group's tp / groups ranks (``to_local(grad_placements=[Shard(0), Partial()])``, summed
    by the gradient sync when backward ends), and the input gradient Partial over all tp
    ranks, summed by the region's all-reduce with the q projection's, or here by one of its own.
    The global view of the weight is the module's own, so checkpoints reshard as any DTensor."""

    def __init__(self, *, groups: int, input_layouts: Any = None) -> None:
        super().__init__()
        self.groups = groups
        # a sequence-sharded input (sequence parallel) is all-gathered on entry, its gradient
        # reduce-scattered back, as ColwiseParallel's is; inside a region it arrives gathered
        self.input_layouts = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        mesh = grouped_mesh(device_mesh, self.groups)
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for name in names:
            param = module._parameters[name]
            dist = distribute_tensor(param.detach(), mesh, [Shard(0), Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(_kv_enter, names=names, tp_mesh=device_mesh, layout=self.input_layouts))
        module.register_forward_hook(_restore_params)
        return module


class ColwiseKVGathered(ParallelStyle):
    """``colwise_kv_gathered``: a k or v projection when tp exceeds the kv heads, every
    weight still split tp ways.

    The weight [kv_heads * head_dim, in] is plain ``Shard(0)`` on the tp axis, so the tp /
    groups ranks of group j (ranks j * tp / groups ...) hold consecutive slices of kv head
    j's rows, the head their query heads read. Each computes ``y_r = x W_r^T``, its slice of
    that head's features, and an all-gather over the group (the inner axis of
    :func:`grouped_mesh`) makes the head whole on each of them, as
    ``colwise_kv_replicated`` holds it. Backward, each rank's gradient of the head is its
    own query heads' share (Partial over the group): the all-gather's backward is then a
    reduce-scatter, which sums the shares and keeps the rank's slice, so the weight gradient
    is complete; the input gradient is Partial over all tp ranks, summed by the region's
    all-reduce with the q projection's."""

    def __init__(self, *, groups: int, input_layouts: Any = None) -> None:
        super().__init__()
        self.groups = groups
        self.input_layouts = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for name in names:
            param = module._parameters[name]
            dist = distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        group = kv_group_mesh(device_mesh, self.groups)
        module.register_forward_pre_hook(partial(_kv_enter, names=names, tp_mesh=device_mesh, layout=self.input_layouts))
        module.register_forward_hook(partial(_gather_in_group, group=group))
        return module


def _gather_in_group(module, args, output, *, group):
    _restore_params(module, args, output)
    # the local slice of the head -> the whole head on each rank of the group; the incoming
    # gradient is this rank's share (Partial), so the backward is a reduce-scatter
    whole = DTensor.from_local(output, group, [Shard(output.dim() - 1)], run_check=False).redistribute(placements=[Replicate()])
    return whole.to_local(grad_placements=(Partial(),))


def _kv_enter(module, args, *, names, tp_mesh, layout):
    _swap_to_local(module, args, names=names, partial_grads=names)
    return tuple(_local_with_partial_grad(a, tp_mesh, layout) if isinstance(a, torch.Tensor) else a for a in args)


def _local_with_partial_grad(x: torch.Tensor, tp_mesh: Any, layout: Any) -> torch.Tensor:
    """A Replicate input as a plain tensor whose gradient is declared Partial: a region's
    DTensor sums it with its other consumers'; a plain input is all-reduced on its own (or,
    arriving sequence-sharded, all-gathered here and its gradient reduce-scattered)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, tp_mesh, [layout], run_check=False)
    if not x.placements[0].is_replicate():
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(grad_placements=(Partial(),))


class _PartialSumsOut:
    """A rowwise output left as each rank's partial sum, a plain tensor, for the module around
    it to add to other partial sums (a MoE block's routed experts) and reduce-scatter once
    where it returns. The gradient that comes back is the whole dL/dy on every rank (y is the
    sum of the ranks' summands), so it is declared Replicate: torch's default for a Partial
    output, Partial, would sum it again."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=output_layouts).to_local(grad_placements=(Replicate(),))


class RowwisePartialSums(_PartialSumsOut, RowwiseParallel):
    pass


class Conv1DRowwisePartialSums(_PartialSumsOut, Conv1DRowwise):
    pass


class GatherPartialGrad(ColwiseParallel):
    """``colwise_gather_output`` whose output's gradient comes back Partial (MLA's latent,
    read by heads split tp ways): the gathered output hands on its local tensor with
    ``grad_placements=[Partial()]``, so the all-gather's backward is a reduce-scatter, which
    both sums the ranks' partial gradients and keeps this rank's features."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=output_layouts).to_local(grad_placements=(Partial(),))


class ReplicatePartialGrad(ParallelStyle):
    """A whole module whose output's gradient comes back Partial (MLA's low-rank projection,
    replicated): its parameters are Replicate DTensors read as local tensors with Partial
    gradients (all-reduced when backward ends, gradsync), and its input is handed on as a
    local tensor whose gradient is Partial too, summed by the region with its siblings' (a
    sequence-sharded input is all-gathered here, its gradient reduce-scattered)."""

    def __init__(self, *, input_layouts: Any = None) -> None:
        super().__init__()
        self.input_layouts = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        _distribute_own(module, names, {}, device_mesh, self.src_data_rank)
        module.register_forward_pre_hook(partial(_kv_enter, names=names, tp_mesh=device_mesh, layout=self.input_layouts))
        module.register_forward_hook(_restore_params)
        return module


class ColwisePartialInput(ColwiseParallel):
    """``colwise`` on a whole input whose gradient is left Partial (an ``Rp`` value): the
    input becomes a Replicate DTensor for the forward, and its Partial gradient goes back as
    this rank's summand, for the module that produced the input to sum."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        return (_FromLocalKeepPartialGrad.apply(x, device_mesh) if not isinstance(x, DTensor) else x, *inputs[1:])


class _FromLocalKeepPartialGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None


class FoldedSlice(ParallelStyle):
    """``PrepareModuleInput(Replicate -> Shard(dim))`` within runs of ``fold`` along ``dim``.

    A value ``[b * heads, ...]`` (heads folded into the batch, ``fold = heads``) read beside
    scores split by heads and folded the same way: rank ``r`` holds rows
    ``i * heads + r * heads / tp ... + heads / tp`` of every run ``i``, the layout
    ``_StridedShard(dim, split_factor=b)`` describes. The plan names the run, not ``b``, so
    any batch size cuts right: ``unflatten(dim, (-1, fold))``, this rank's chunk of the run,
    ``flatten`` back. The input needs no gradient (a bias made from the mask), so the cut,
    local and collective-free, has no backward to speak of."""

    def __init__(self, *, input: int | str, dim: int, fold: int) -> None:
        super().__init__()
        self.input, self.dim, self.fold = input, dim, fold

    def _cut(self, x: Any, device_mesh) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, DTensor):
            x = x.full_tensor()
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        d = self.dim % x.dim()
        if self.fold % tp or x.shape[d] % self.fold:
            raise ValueError(f"an input of shape {tuple(x.shape)} cannot be cut in runs of {self.fold} along dim {d} "
                             f"{tp} ways; the plan expected dim {d} to be a multiple of {self.fold} (the heads), "
                             f"{tp} dividing it: plan again for this model")
        width = self.fold // tp
        return x.unflatten(d, (-1, self.fold)).narrow(d + 1, rank * width, width).flatten(d, d + 1)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(mod, args, kwargs):
            if isinstance(self.input, int):
                args = tuple(self._cut(a, device_mesh) if i == self.input else a for i, a in enumerate(args))
            elif self.input in kwargs:
                kwargs = {**kwargs, self.input: self._cut(kwargs[self.input], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class NormSharded(ParallelStyle):
    """``norm_sharded``: the module's own code on a ``Shard(-1)`` DTensor of its input.

    ``y = x / rms(x) * w`` over features split tp ways: DTensor computes the statistic
    ``x.pow(2).mean(-1)`` as a partial result and all-reduces it (``[b, s, 1]``, one value per
    row) before ``rsqrt``, the rest stays on each rank's features, and ``w`` (and a bias) are
    ``Shard(0)`` with them, so their gradients are each rank's own rows. The output goes on
    as the local ``Shard(-1)`` tensor, as colwise's does. Torch's ``nn.RMSNorm`` calls one
    fused kernel, which DTensor would run on whole features (an all-gather): it runs written
    out instead (:func:`_rms_norm_written_out`)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module) is nn.RMSNorm:
            module.forward = partial(_rms_norm_written_out, module)
        for name, p in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))

        def enter(mod, args):
            x, features = args[0], Shard(args[0].dim() - 1)
            x = x.redistribute(device_mesh, [features]) if isinstance(x, DTensor) else DTensor.from_local(
                x, device_mesh, [features], run_check=False)
            return (x, *args[1:])

        def leave(mod, args, output):
            return output.to_local() if isinstance(output, DTensor) else output

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


def _rms_norm_written_out(module: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``F.rms_norm`` over the last dim as its reductions: ``x / sqrt(mean(x^2) + eps) * w``,
    in fp32 for lower-precision inputs as the fused kernel computes it. On a ``Shard(-1)``
    DTensor the ``mean`` is a partial sum over the ranks' features, all-reduced once."""
    eps = torch.finfo(x.dtype).eps if module.eps is None else module.eps
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * module.weight if module.weight is not None else y
