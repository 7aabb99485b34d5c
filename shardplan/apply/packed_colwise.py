"""PackedColwise: the colwise style of a fused projection that the code cuts into parts.

Contract
--------
``PackedColwise(parts=..., conv1d=..., whole_parts=..., groups=...)`` is applied by
``parallelize_module`` like torch's ``ColwiseParallel``. Its weight (and bias) are placed
:func:`.styles.packed_placement` on the output features: rank r keeps its slice of every
part (``[gate_r; up_r]``, ``[q_r; k_r; v_r]``), whose global view is the module's own row
order. Equal parts run as ``ColwiseParallel``; unequal ones (:class:`.packed.PackedShard`)
on local tensors. With ``whole_parts`` (k and v of fewer heads than ranks, fused after the
query heads) the last parts are gathered after the matmul over the ranks of their kv head
(``groups``; all of tp for one), so a rank holds ``[q_r, k_g, v_g]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

from .mesh import kv_group_mesh
from .packed import PackedShard, check_parts, distribute
from .styles import _restore_params, _swap_to_local, packed_placement

__all__ = ["PackedColwise"]


class PackedColwise(ColwiseParallel):
    """ColwiseParallel for a fused projection split by ``chunk(parts, -1)`` downstream. The
    weight is ``packed_placement`` on its output features, so ``y = x W^T`` comes out
    ``_StridedShard(-1)`` with no collective, and its local tensor is [gate_r, up_r]: the
    slices the downstream ``chunk`` needs, handed on as they are (a redistribute to
    ``Shard(-1)`` would be an all-to-all for nothing).

    ``parts`` a list of unequal relative widths (GQA's [Q; K; V] cut by ``split([h*hd,
    kv*hd, kv*hd], -1)``): the weight (and bias) are :class:`.packed.PackedShard`, rank r
    holding [q_r; k_r; v_r], and the module runs on its local tensors: its input is made
    whole (``input_layouts`` -> Replicate; its gradient, partial on each rank, is summed
    backward), its output is the local [q_r, k_r, v_r] (a DTensor placed ``PackedShard(-1)``
    with ``use_local_output=False``), and the parameters' gradients keep their placement,
    which a DTensor matmul would relabel as an equal-parts ``_StridedShard``.

    ``whole_parts`` (k and v of fewer heads than ranks, after the query heads): the last parts
    of the local output are all-gathered over ``groups`` ranks (the ranks of one kv head; all
    of tp for one), so a rank hands on ``[q_r, k_g, v_g]`` (:func:`_gather_tail`)."""

    def __init__(self, *, parts: int | Sequence[int], conv1d: bool = False, whole_parts: int = 0, groups: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts, self.conv1d = (parts if isinstance(parts, int) else tuple(parts)), conv1d
        # fewer kv heads than ranks in a fused [Q; K; V]: the last parts (k, v) gathered
        # after the matmul over the ranks of each kv head (all of tp for one kv head)
        self.whole_parts, self.groups = whole_parts, groups

    def _unequal(self) -> bool:
        return not isinstance(self.parts, int) and len(set(self.parts)) > 1

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self._unequal() or self.whole_parts:
            return self._apply_local(module, device_mesh)
        if not self.conv1d:
            return super()._apply(module, device_mesh)
        # HF's Conv1D (y = x W + b, W [in, out]): torch's colwise knows only nn.Linear
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def _out_dim(self, param: torch.Tensor) -> int:
        # the output features: nn.Linear's weight dim 0, Conv1D's dim 1; a bias's dim 0
        return 1 if self.conv1d and param.dim() == 2 else 0

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = self._out_dim(param)
            if self._unequal() or self.whole_parts:
                check_parts(self.parts, param.shape[dim], device_mesh.size(),
                            what=f"packed_colwise on {type(module).__name__}.{pname} {list(param.shape)}")
            where = packed_placement(parts=self.parts, dim=dim)
            dist = distribute(param.detach(), device_mesh, [where], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply_local(self, module: nn.Module, device_mesh) -> nn.Module:
        self._partition_linear_fn("", module, device_mesh)
        names = [n for n, _ in module.named_parameters(recurse=False)]
        layout = self.input_layouts[0] if isinstance(self.input_layouts, tuple) else self.input_layouts
        module.register_forward_pre_hook(partial(_packed_enter, names=names, mesh=device_mesh, layout=layout))
        module.register_forward_hook(partial(_packed_leave, mesh=device_mesh, parts=self.parts,
                                             use_local_output=self.use_local_output, whole_parts=self.whole_parts,
                                             group=kv_group_mesh(device_mesh, self.groups) if self.whole_parts else None))
        return module

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs


def _packed_enter(module, args, *, names, mesh, layout):
    """The input whole on every rank (an all-gather from ``layout``; nothing from Replicate),
    as a plain tensor whose gradient (each rank's share) is summed backward; the parameters
    their local [q_r; k_r; v_r]."""
    x, *rest = args
    if isinstance(x, torch.Tensor):
        dx = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [layout], run_check=False)
        if not dx.placements[0].is_replicate():
            dx = dx.redistribute(mesh, [Replicate()])
        x = dx.to_local(grad_placements=[Partial()])
    _swap_to_local(module, args, names=names)
    return (x, *rest)


def _packed_leave(module, args, output, *, mesh, parts, use_local_output, whole_parts=0, group=None):
    _restore_params(module, args, output)
    if whole_parts and isinstance(output, torch.Tensor):
        return _gather_tail(output, mesh.size(), group, parts, whole_parts)
    if use_local_output or not isinstance(output, torch.Tensor):
        return output
    shape = list(output.shape)
    shape[-1] *= mesh.size()
    return DTensor.from_local(output, mesh, [PackedShard(output.ndim - 1, parts=parts)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def _gather_tail(output: torch.Tensor, tp: int, group: Any, parts: Sequence[int], whole_parts: int) -> torch.Tensor:
    """[q_r, k_r, v_r] -> [q_r, k_g, v_g]: the rank's slices of the last ``whole_parts``
    parts (k and v) all-gathered, in one collective, over ``group``: the ranks holding the
    slices of one kv head (all of tp for one kv head), so every rank holds its query heads'
    kv head whole. Each rank's gradient of it is its own query heads' share (Partial): the
    gather's backward is then a reduce-scatter, summing the shares and keeping the slices."""
    local = [rows // tp for rows in check_parts(parts, output.shape[-1] * tp, tp, what="packed_colwise's output")]
    keep, tail = local[:-whole_parts], local[-whole_parts:]
    *lead, mine = output.split([*keep, sum(tail)], dim=-1)
    whole = DTensor.from_local(mine, group, [Shard(output.ndim - 1)], run_check=False).redistribute(placements=[Replicate()])
    # [k_0, v_0, k_1, v_1, ...] (rank by rank) -> [k, v]: each piece's slices side by side
    ranks = whole.to_local(grad_placements=(Partial(),)).unflatten(-1, (group.size(), sum(tail)))
    return torch.cat([*lead, *(piece.flatten(-2) for piece in ranks.split(tail, dim=-1))], dim=-1)


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
