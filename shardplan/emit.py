"""Emit: turn a :class:`~shardplan.plan.Plan` into torch tensor-parallel styles and apply them.

Contract
--------
``to_parallelize_plan(plan)`` returns the ``{pattern: ParallelStyle}`` dict that
``torch.distributed.tensor.parallel.parallelize_module`` takes; ``apply_plan(model,
device_mesh, plan)`` applies it on the plan's tensor-parallel axis, re-ties shared weights,
and installs the gradient hooks sequence parallel needs. This is the only module that
imports the TP styles. Between modules activations stay plain local tensors
(``use_local_output=True``), except inside a region, where the input enters DTensor once
(``PrepareModuleInput(..., use_local_output=False)``) so the Partial gradients of its
Linears add up before one collective.
"""

from __future__ import annotations

import re
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from .plan import Plan, Region, Rule, expand_pattern

__all__ = [
    "ReplicateParallel", "MoEExpertsParallel", "unpack_experts", "unpack_packed", "to_parallelize_plan", "apply_plan", "tp_mesh",
    "check_fingerprint",
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


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; inputs and outputs stay plain tensors.

    Keeps every parameter of a TP model a DTensor (optimizers' foreach kernels cannot mix
    DTensor and plain tensors) without changing the math: a replicated module on replicated
    inputs computes the same thing on every rank, and its gradients need no collective.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _inputs_to_replicate, _outputs_to_local)


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


class _Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for Hugging Face's Conv1D, whose weight is [in, out]: split dim 1."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, _conv1d_partition(Shard(1), Shard(0), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _Conv1DRowwise(RowwiseParallel):
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
    bmm layout [E, H, X] / [E, I, H] on the same features); when X is
    gate and up packed (X = 2I, split by ``chunk(2)``), each rank keeps matching slices of
    both halves (packed). The parameters are DTensors (Shard(1) / Shard(2)); the forward runs
    on their local shards, sums the partial outputs with one all-reduce, and all-reduces the
    gradients of the inputs it consumed whole. The packed weight's global DTensor view holds
    [gate_0, up_0, gate_1, up_1, ...]; ``unpack_experts`` restores the module's own order.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from .graph import expert_params

        ep = expert_params(module)
        up, down = ep.up, ep.down
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        whole = distribute_tensor(getattr(module, up).detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
        local = _packed_slice(whole.to_local(), parts=2 if ep.packed else 1, dim=ep.up_dim, tp=tp, rank=rank)
        up_param = DTensor.from_local(local, device_mesh, [Shard(ep.up_dim)], run_check=False)
        module.register_parameter(up, nn.Parameter(up_param, requires_grad=getattr(module, up).requires_grad))
        down_param = distribute_tensor(getattr(module, down).detach(), device_mesh, [Shard(ep.down_dim)], src_data_rank=self.src_data_rank)
        module.register_parameter(down, nn.Parameter(down_param, requires_grad=getattr(module, down).requires_grad))
        group = device_mesh.get_group().group_name
        module.register_forward_pre_hook(partial(_experts_enter, names=(up, down), group=group), with_kwargs=True)
        module.register_forward_hook(partial(_experts_leave, names=(up, down), group=group))
        return module


def _packed_slice(full: torch.Tensor, *, parts: int, dim: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of every part, concatenated: [gate_r, up_r]."""
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in full.chunk(parts, dim=dim)], dim=dim).contiguous()


def unpack_packed(full: torch.Tensor, *, tp: int, parts: int = 2, dim: int = 0) -> torch.Tensor:
    """The module's own order ([gate; up]) from a packed parameter's ``full_tensor()``, whose
    global view is [gate_0, up_0, gate_1, up_1, ...]."""
    shards = full.chunk(tp, dim=dim)
    return torch.cat([torch.cat([s.chunk(parts, dim=dim)[b] for s in shards], dim=dim) for b in range(parts)], dim=dim)


def unpack_experts(full: torch.Tensor, *, tp: int, blocks: int = 2, dim: int = 1) -> torch.Tensor:
    """``unpack_packed`` for an experts bank's up projection ([E, 2I, H]: dim 1; bmm layout: 2)."""
    return unpack_packed(full, tp=tp, parts=blocks, dim=dim)


class _PackedColwise(ColwiseParallel):
    """ColwiseParallel for a fused projection split by ``chunk(parts, -1)`` downstream."""

    def __init__(self, *, parts: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        for pname, param in list(module.named_parameters(recurse=False)):
            whole = distribute_tensor(param.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            local = _packed_slice(whole.to_local(), parts=self.parts, dim=0, tp=tp, rank=rank)
            dist = DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


def _experts_enter(module, args, kwargs, *, names, group):
    # run on local shards; to_local is differentiable, so gradients reach the DTensor params
    _swap_to_local(module, args, names=names)
    wrap = lambda x: _CopyToTP.apply(x, group) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad else x  # noqa: E731
    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


def _experts_leave(module, args, output, *, names, group):
    _restore_params(module, args, output, names=names)
    return _ReduceFromTP.apply(output, group)


def _style(rule: Rule, *, conv1d: bool = False) -> ParallelStyle:
    inp = placement(rule.input_layouts)
    out = placement(rule.output_layouts)
    col, row = (_Conv1DColwise, _Conv1DRowwise) if conv1d else (ColwiseParallel, RowwiseParallel)
    if rule.style == "colwise":  # an explicit Shard(-1) output is returned to the user as a DTensor
        return col(input_layouts=inp or Replicate(), output_layouts=out or Shard(-1), use_local_output=out is None)
    if rule.style == "packed_colwise":
        return _PackedColwise(parts=rule.packed or 2, input_layouts=inp or Replicate(), output_layouts=Shard(-1))
    if rule.style == "colwise_gather_output":
        return col(input_layouts=inp or Replicate(), output_layouts=out or Replicate())
    if rule.style == "rowwise":  # a Partial output stays a DTensor for the block's exit to sum
        return row(input_layouts=inp or Shard(-1), output_layouts=out or Replicate(), use_local_output=not isinstance(out, Partial))
    if rule.style == "rowwise_split_input":  # Replicate -> Shard(-1) is a local slice
        return row(input_layouts=Replicate(), output_layouts=out or Replicate())
    if rule.style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=inp or Replicate(), output_layouts=out or Replicate())
    if rule.style in ("sequence_parallel", "replicated_with_grad_allreduce"):
        return SequenceParallel(sequence_dim=(inp or Shard(1)).dim, use_local_output=True)
    if rule.style == "moe_tp_experts":
        return MoEExpertsParallel()
    if rule.style == "replicate":
        return ReplicateParallel()
    raise ValueError(f"style {rule.style!r} of {rule.module!r} has no emitter; expected one of colwise, rowwise, ...")


def _region_style(region: Region) -> ParallelStyle:
    layout, desired = placement(region.input_layouts), placement(region.desired_input_layouts)
    if region.input == "output":
        return PrepareModuleOutput(output_layouts=layout, desired_output_layouts=desired, use_local_output=region.use_local_output)
    if isinstance(region.input, int):
        layouts = [None] * region.num_inputs
        wanted = [None] * region.num_inputs
        layouts[region.input], wanted[region.input] = layout, desired
        return PrepareModuleInput(input_layouts=tuple(layouts), desired_input_layouts=tuple(wanted), use_local_output=False)
    return PrepareModuleInput(
        input_kwarg_layouts={region.input: layout}, desired_input_kwarg_layouts={region.input: desired}, use_local_output=False,
    )


class _ContainerParams(ParallelStyle):
    """A module that owns parameters and also has weight-bearing children (ViT's embeddings
    own ``cls_token``; a Mamba mixer reads ``self.conv1d.weight`` without calling conv1d):
    those parameters (``paths``, relative to the module) become Replicate DTensors, so foreach
    optimizers see one kind of tensor, and its forward sees their local tensors, since its
    other inputs are plain. ``to_local`` is differentiable: gradients reach the DTensors."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = paths

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for path in self.paths:
            owner, name = _owner(module, path)
            p = owner._parameters[name]
            if not isinstance(p, DTensor):
                dist = distribute_tensor(p.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
                owner.register_parameter(name, nn.Parameter(dist, requires_grad=p.requires_grad))
        module.register_forward_pre_hook(partial(_swap_to_local, names=self.paths))
        module.register_forward_hook(partial(_restore_params, names=self.paths))
        return module


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), name


def _swap_to_local(module, args, *, names):
    module._shardplan_params = {}
    for path in names:
        owner, name = _owner(module, path)
        module._shardplan_params[path] = owner._parameters[name]
        owner._parameters[name] = owner._parameters[name].to_local()


def _restore_params(module, args, output, *, names):
    for path, param in module._shardplan_params.items():
        owner, name = _owner(module, path)
        owner._parameters[name] = param
    del module._shardplan_params


class _CopyOutput(ParallelStyle):
    """Hand on a copy of the output: downstream code modifies it in place, which autograd
    forbids on the local view ``DTensor.to_local`` returns."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _i, out: out.clone() if isinstance(out, torch.Tensor) else out)
        return module


class _Both(ParallelStyle):
    """Two styles on one module (a block's entry and exit), applied in order."""

    def __init__(self, first: ParallelStyle, second: ParallelStyle) -> None:
        self.first, self.second = first, second

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return self.second._apply(self.first._apply(module, device_mesh), device_mesh)


def _combine(existing: ParallelStyle | None, new: ParallelStyle) -> ParallelStyle:
    return new if existing is None else _Both(existing, new)


def to_parallelize_plan(plan: Plan, model: nn.Module | None = None) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` dict: regions first, then one style per rule."""
    styles: dict[str, ParallelStyle] = {}
    for r in plan.regions:
        if r.input == "output" and not r.use_local_output:
            continue  # applied after the module's own style (apply_plan)
        styles[r.module] = _combine(styles.get(r.module), _region_style(r))
    conv1d = _conv1d_rules(plan, model)
    adopted = _adopted_params(plan, model)
    for rule in plan.rules:
        if rule.module in adopted:
            styles[rule.module] = _ContainerParams(adopted[rule.module])  # its children carry their own styles
        elif not _never_called(rule) or not any(c == "" or rule.module.startswith(c + ".") for c in adopted):
            styles[rule.module] = _style(rule, conv1d=rule.module in conv1d)
    return styles


def _never_called(rule: Rule) -> bool:
    return rule.style == "replicate" and rule.why.startswith("not called in forward")


def _adopted_params(plan: Plan, model: nn.Module | None) -> dict[str, list[str]]:
    """Container rule -> the parameter paths its forward uses directly: its own, and those of
    descendants it never calls (their weights are read as attributes)."""
    if model is None:
        return {}
    from .trace import is_weight_leaf, owns_params

    out = {}
    for rule in plan.rules:
        fqns = expand_pattern(rule.module, plan.model.repeats)
        mod = model.get_submodule(fqns[0]) if fqns else None
        if mod is None or rule.style != "replicate" or not owns_params(mod) or is_weight_leaf(mod):
            continue  # a container: owns parameters and has weight-bearing descendants
        c = rule.module
        prefix = f"{c}." if c else ""
        paths = [n for n, _ in mod.named_parameters(recurse=False)]
        for r in plan.rules:
            if r.module != c and r.module.startswith(prefix) and _never_called(r):
                rel = r.module[len(prefix):]
                paths += [f"{rel}.{n}" for n, _ in mod.get_submodule(rel).named_parameters(recurse=False)]
        out[c] = paths
    return out



def _conv1d_rules(plan: Plan, model: nn.Module | None) -> set[str]:
    if model is None:
        return set()
    from .graph import module_kind
    from .plan import expand_pattern

    found = set()
    for rule in plan.rules:
        fqns = expand_pattern(rule.module, plan.model.repeats)
        if fqns and module_kind(model.get_submodule(fqns[0])) == "conv1d":
            found.add(rule.module)
    return found


def tp_mesh(device_mesh, plan: Plan):
    names = device_mesh.mesh_dim_names
    if device_mesh.ndim == 1:
        return device_mesh
    if not names or plan.mesh.tp_axis not in names:
        raise ValueError(f"the plan's tp axis {plan.mesh.tp_axis!r} is not in the mesh's axes {names}")
    return device_mesh[plan.mesh.tp_axis]


def check_fingerprint(model: nn.Module, plan: Plan) -> None:
    from .plan import fingerprint

    got = fingerprint(model)
    if got != plan.model.fingerprint:
        raise ValueError(
            f"this plan was made for a {plan.model.class_name} with fingerprint {plan.model.fingerprint}, "
            f"but the model given is a {type(model).__name__} with {got}; re-plan it with `shardplan plan`"
        )


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, mod in model.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((fqn, name))
    return [group for group in owners.values() if len(group) > 1]


def _reduce_partial_grad(param: torch.Tensor) -> None:
    """Sequence-parallel norm weights get Partial gradients (a sum over the local tokens);
    make them Replicate once per backward instead of inside every optimizer kernel."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def apply_plan(model: nn.Module, device_mesh, plan: Plan, *, check: bool = True) -> nn.Module:
    """Shard ``model`` in place on ``device_mesh`` as ``plan`` says; returns the model."""
    if check:
        check_fingerprint(model, plan)
        from .validate import check_findings

        for finding in check_findings(plan, model):  # a rule that matches nothing, a weight no rule covers
            warnings.warn(f"apply_plan: {finding}", stacklevel=2)
    mesh = tp_mesh(device_mesh, plan)
    if mesh.size() != plan.tp:
        raise ValueError(f"the plan was made for tp={plan.tp} but the mesh's tp axis has {mesh.size()} ranks; re-plan for this mesh")
    tied = _tied_groups(model)
    parallelize_module(model, mesh, to_parallelize_plan(plan, model))
    # output regions hook in after the module's own style has turned its output local
    outputs = {r.module: _region_style(r) for r in plan.regions if r.input == "output" and not r.use_local_output}
    for rule in plan.rules:
        if rule.copy_output:
            outputs[rule.module] = _combine(outputs.get(rule.module), _CopyOutput())
    if outputs:
        parallelize_module(model, mesh, outputs)
    for group in tied:
        # re-tie to the copy a sharding style produced (a replicated or plain copy would
        # silently un-shard the other owner)
        copies = [getattr(model.get_submodule(fqn), name) for fqn, name in group]
        shared = next((c for c in copies if isinstance(c, DTensor) and not c.placements[0].is_replicate()), copies[0])
        for fqn, name in group:
            setattr(model.get_submodule(fqn), name, shared)
    for fqn, style in plan.module_styles().items():
        if style in ("sequence_parallel", "replicated_with_grad_allreduce"):
            for p in model.get_submodule(fqn).parameters(recurse=False):
                p.register_post_accumulate_grad_hook(_reduce_partial_grad)
    return model
