"""Emit: turn a :class:`~shardplan.plan.model.Plan` into tensor-parallel styles and apply them.

Contract
--------
``to_parallelize_plan(plan)`` returns the ``{pattern: ParallelStyle}`` dict that
``torch.distributed.tensor.parallel.parallelize_module`` takes; ``apply_plan(model,
device_mesh, plan)`` applies it on the plan's tensor-parallel axis, re-ties shared weights,
and installs the gradient hooks sequence parallel needs. This module and
the style modules (:mod:`.styles`, :mod:`.head_styles`, :mod:`.attention_style`: the styles
shardplan adds) are the only ones that import torch's TP styles. Between modules activations stay plain local tensors
(``use_local_output=True``), except inside a region, where the input enters DTensor once
(``PrepareModuleInput(..., use_local_output=False)``) so the Partial gradients of its
Linears add up before one collective.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..analyze.graph import EXPERT_CONTAINERS
from ..plan.model import Plan, Region, Rule, expand_braces, expand_pattern, set_int_attribute

from .agree import agree
from .buffers import set_local_buffers
from .experts_ep import ExpertParallel, WholeExperts
from .experts_listed import shard_listed_experts
from .dtensor_style import DTensorWeights
from .listed_style import ListedHeadsParallel
from .attention_style import MultiheadAttentionParallel
from .gradsync import install_gradient_sync
from .localviews import install_local_views
from .head_styles import (
    ColwiseKVGathered, ColwiseKVReplicated, ColwisePartialInput, Conv1DRowwisePartialSums, FoldedSlice, GatherPartialGrad, NormSharded,
    ReplicatePartialGrad, RowwisePartialSums,
)
from .packed_colwise import PackedColwise
from .tied_style import tied_reads
from .token_style import TokenScatter
from .styles import (
    AsLinear, Conv1DColwise, Conv1DRowwise, ContainerParams, CopyOutput, LocalVocabParallel, MoEExpertsParallel,
    Both, ReplicateParallel, SharedInput, combine, local_during_forward, placement, runs_on_local_tensors,
)

__all__ = [
    "ReplicateParallel", "MoEExpertsParallel", "to_parallelize_plan", "apply_plan", "shard",
    "tp_mesh", "check_fingerprint",
]


def _style(rule: Rule, *, conv1d: bool = False, own_forward: bool = False, scalars: bool = False) -> ParallelStyle:
    inp = placement(rule.input_layouts)
    out = placement(rule.output_layouts)
    col, row = (Conv1DColwise, Conv1DRowwise) if conv1d else (ColwiseParallel, RowwiseParallel)
    if rule.style == "colwise" and rule.input_grad_partial:
        return ColwisePartialInput(input_layouts=Replicate(), output_layouts=Shard(-1))
    if rule.style == "colwise_gather_output" and rule.output_grad_partial:
        return GatherPartialGrad(input_layouts=inp or Replicate(), output_layouts=Replicate())
    if rule.style == "replicated_with_grad_allreduce" and rule.output_grad_partial:
        return ReplicatePartialGrad(input_layouts=inp)
    if rule.style == "replicated_with_grad_allreduce" and (isinstance(inp, Replicate) or scalars):
        # whole parameters on this rank's entries (an elementwise activation with scalar
        # parameters on a shard): plain tensors, the gradients summed when backward ends
        return ReplicateParallel(partial_grads=True)
    if rule.style == "colwise":  # an explicit Shard(-1) output is returned to the user as a DTensor
        return col(input_layouts=inp or Replicate(), output_layouts=out or Shard(-1), use_local_output=out is None)
    if rule.style == "packed_colwise":
        return PackedColwise(parts=rule.packed or 2, conv1d=conv1d, whole_parts=rule.whole_parts or 0, groups=rule.groups or 1,
                             input_layouts=inp or Replicate(),
                             output_layouts=Shard(-1))
    if rule.style == "colwise_kv_replicated":
        return ColwiseKVReplicated(groups=rule.groups, input_layouts=inp)
    if rule.style == "colwise_kv_gathered":
        return ColwiseKVGathered(groups=rule.groups, input_layouts=inp)
    if rule.style == "colwise_gather_output":
        return col(input_layouts=inp or Replicate(), output_layouts=out or Replicate())
    if rule.style == "rowwise" and isinstance(out, Partial) and rule.use_local_output is not False:
        return (Conv1DRowwisePartialSums if conv1d else RowwisePartialSums)(input_layouts=inp or Shard(-1), output_layouts=out)
    if rule.style == "rowwise":  # a Partial output kept a DTensor for the block's exit to sum
        return row(input_layouts=inp or Shard(-1), output_layouts=out or Replicate(), use_local_output=not isinstance(out, Partial))
    if rule.style == "rowwise_split_input":  # Replicate -> Shard(-1) is a local slice
        return row(input_layouts=Replicate(), output_layouts=out or Replicate())
    if rule.style == "embedding_rowwise" and own_forward:
        return LocalVocabParallel(output_layouts=out)
    if rule.style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=inp or Replicate(), output_layouts=out or Replicate())
    if rule.style == "norm_sharded":
        return NormSharded()
    if rule.style in ("sequence_parallel", "replicated_with_grad_allreduce"):
        dim = (inp or Shard(1)).dim
        if isinstance(out, Replicate):  # a returned norm's output gathered for the user
            return Both(SequenceParallel(sequence_dim=dim, use_local_output=False),
                        PrepareModuleOutput(output_layouts=Shard(dim), desired_output_layouts=Replicate()))
        return SequenceParallel(sequence_dim=dim, use_local_output=True)
    if rule.style == "moe_tp_experts":
        return MoEExpertsParallel(reduce_output=not isinstance(out, Partial),
                                  sequence_dim=inp.dim if isinstance(inp, Shard) else None)
    if rule.style == "moe_whole_experts":
        return WholeExperts(reduce_output=not isinstance(out, Partial))
    if rule.style == "attention_heads":
        return MultiheadAttentionParallel(input_layouts=inp, output_layouts=out)
    if rule.style == "listed_heads":
        return ListedHeadsParallel(input_layouts=inp, output_layouts=out)
    if rule.style == "dtensor_weights":
        return DTensorWeights(placements={n: placement(p) for n, p in rule.param_layouts.items()},
                              input_layouts=inp, output_layouts=out)
    if rule.style == "replicate":
        return ReplicateParallel(output_layouts=out, local=rule.read_outside)
    raise ValueError(f"style {rule.style!r} of {rule.module!r} has no emitter; expected one of colwise, rowwise, ...")


def _experts_over_ep(model: nn.Module, device_mesh, plan: Plan) -> None:
    """``ep_experts`` rules: whole experts over the ep axis's sub-mesh, each bank's forward
    replaced by the all-to-all dispatch (:class:`.experts_ep.ExpertParallel`)."""
    rules = [r for r in plan.rules if r.style == "ep_experts" and not _listed(r, model, plan)]
    if not rules:
        return
    names = device_mesh.mesh_dim_names or ()
    if plan.mesh.ep_axis not in names or device_mesh[plan.mesh.ep_axis].size() != plan.ep:
        raise ValueError(f"the plan splits experts over {plan.mesh.ep_axis}={plan.ep}, but the mesh's axes are "
                         f"{dict(zip(names, device_mesh.mesh.shape))}; make the mesh with mesh_dim_names naming "
                         f"{plan.mesh.ep_axis!r}, as the plan's mesh {plan.mesh.axes} does")
    # with a tp axis the rank's experts sit on it too (split inside, or whole on each tp rank)
    axes = (plan.mesh.ep_axis, plan.mesh.tp_axis) if plan.tp > 1 else (plan.mesh.ep_axis,)
    if plan.tp > 1 and plan.mesh.tp_axis not in names:
        raise ValueError(f"the plan splits experts over {plan.mesh.ep_axis} and {plan.mesh.tp_axis}, but the mesh's "
                         f"axes are {names}; make the mesh with the plan's axes {tuple(plan.mesh.axes)}")
    mesh = device_mesh[axes[0]] if len(axes) == 1 else device_mesh[axes]
    # a folded rule's index set (``layers.{1-3}``: DeepSeek's dense first layers) is one key per
    # index: parallelize_module has no index sets, and skips a key it cannot match with a warning
    parallelize_module(model, mesh, _fnmatch_keys({r.module: ExpertParallel(
        inner_tp=r.inner == "moe_tp_experts", reduce_output=r.output_layouts != "Partial") for r in rules}))


def _listed(rule: Rule, model: nn.Module, plan: Plan) -> bool:
    """An ``ep_experts`` rule on an ``nn.ModuleList`` of experts (not a 3-D bank)."""
    return any(isinstance(model.get_submodule(f), EXPERT_CONTAINERS) for f in expand_pattern(rule.module, plan.model.repeats))


def _lists_over_ep(model: nn.Module, device_mesh, plan: Plan) -> None:
    """``ep_experts`` rules on lists of experts (:mod:`.experts_listed`): applied after the
    tensor-parallel styles, which split each expert inside as the plan says, so that the
    experts other ranks hold are dropped whole."""
    lists = [f for r in plan.rules if r.style == "ep_experts" and _listed(r, model, plan)
             for f in expand_pattern(r.module, plan.model.repeats)]
    for fqn in lists:
        layer, _, child = fqn.rpartition(".")
        shard_listed_experts(model.get_submodule(layer), child, device_mesh[plan.mesh.ep_axis])


def _region_style(region: Region) -> ParallelStyle:
    layout, desired = placement(region.input_layouts), placement(region.desired_input_layouts)
    if region.fold is not None:  # heads folded into the batch: the rank's heads of every row
        return FoldedSlice(input=region.input, dim=desired.dim, fold=region.fold)
    if region.tokens_of is not None:  # partial sums over tokens the module flattened itself
        return TokenScatter(tokens_of=region.tokens_of, output_index=region.output_index, num_outputs=region.num_outputs)
    if region.input == "output" and region.output_index is not None:  # one element of a returned tuple
        layouts, wanted = [None] * region.num_outputs, [None] * region.num_outputs
        layouts[region.output_index], wanted[region.output_index] = layout, desired
        return PrepareModuleOutput(output_layouts=tuple(layouts), desired_output_layouts=tuple(wanted),
                                   use_local_output=region.use_local_output)
    if region.input == "output":
        return PrepareModuleOutput(output_layouts=layout, desired_output_layouts=desired, use_local_output=region.use_local_output)
    if isinstance(region.input, int):
        layouts = [None] * region.num_inputs
        wanted = [None] * region.num_inputs
        layouts[region.input], wanted[region.input] = layout, desired
        return SharedInput(input_layouts=tuple(layouts), desired_input_layouts=tuple(wanted),
                           use_local_output=region.use_local_output)
    return SharedInput(
        input_kwarg_layouts={region.input: layout}, desired_input_kwarg_layouts={region.input: desired},
        use_local_output=region.use_local_output,
    )


def to_parallelize_plan(plan: Plan, model: nn.Module | None = None) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` dict: regions first, then one style per rule."""
    styles: dict[str, ParallelStyle] = {}
    for r in plan.regions:
        if r.input == "output" and not r.use_local_output:
            continue  # applied after the module's own style (apply_plan)
        styles[r.module] = combine(styles.get(r.module), _region_style(r))
    conv1d, own_forward = _conv1d_rules(plan, model), _own_forward_embeddings(plan, model)
    scalars = _rules_where(plan, model, lambda m: bool(params := list(m.parameters())) and all(p.numel() == 1 for p in params))
    by_hand = _linear_like_rules(plan, model)
    adopted = _adopted_params(plan, model)
    for rule in _one_rule_per_module(plan, model):
        if rule.style == "ep_experts":
            continue  # on the ep axis's sub-mesh (_experts_over_ep)
        if rule.module in adopted:
            # combined with a region's PrepareModuleInput on the same module (gpt-oss's self_attn
            # owns ``sinks`` and is the q/k/v region): replacing it would drop the shared all-reduce
            styles[rule.module] = combine(styles.get(rule.module), ContainerParams(adopted[rule.module], placements={
                name: placement(layout) for name, layout in rule.param_layouts.items()},
                partial_grads=rule.partial_grads))  # children carry their own styles
        elif not _never_called(rule) or not any(c == "" or rule.module.startswith(c + ".") for c in adopted):
            style = _style(rule, conv1d=rule.module in conv1d, own_forward=rule.module in own_forward,
                           scalars=rule.module in scalars)
            styles[rule.module] = combine(styles.get(rule.module), AsLinear(style) if rule.module in by_hand else style)
    return _fnmatch_keys(styles)


def _one_rule_per_module(plan: Plan, model: nn.Module | None) -> list[Rule]:
    """The rules, less one whose modules are all objects an earlier rule already styles: a
    module registered under two names (x-transformers' decoder ``token_emb`` is the encoder's)
    is one module, and a style applies to it once. Its rules agree, since the solver shards a
    shared parameter one way."""
    if model is None:
        return list(plan.rules)
    seen: set[int] = set()
    out = []
    for rule in plan.rules:
        objects = {id(model.get_submodule(f)) for f in expand_pattern(rule.module, plan.model.repeats)}
        if not objects or not objects <= seen:
            out.append(rule)
        seen |= objects
    return out


def _fnmatch_keys(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``parallelize_module`` matches keys segment by segment with fnmatch, which has no
    index sets: a folded rule's ``{3-60}`` becomes one key per index."""
    return {key: style for pattern, style in styles.items() for key in expand_braces(pattern)}


def _never_called(rule: Rule) -> bool:
    return rule.style == "replicate" and rule.why.startswith("not called in forward")


def _adopted_params(plan: Plan, model: nn.Module | None) -> dict[str, list[str]]:
    """Container rule -> the parameter paths its forward uses directly: its own, and those of
    descendants it never calls (their weights are read as attributes)."""
    if model is None:
        return {}
    from ..analyze.trace import is_weight_leaf, owns_params

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
    from ..analyze.graph import module_kind

    return _rules_where(plan, model, lambda m: module_kind(m) == "conv1d")


def _linear_like_rules(plan: Plan, model: nn.Module | None) -> set[str]:
    """Rules that split a Linear written by hand (torch's Linear styles take nn.Linear only)."""
    from ..analyze.graph import linear_like

    split = {r.module for r in plan.rules if r.style != "replicate"}
    return _rules_where(plan, model, linear_like) & split


def _rules_where(plan: Plan, model: nn.Module | None, test) -> set[str]:
    if model is None:
        return set()
    found = set()
    for rule in plan.rules:
        fqns = expand_pattern(rule.module, plan.model.repeats)
        if fqns and test(model.get_submodule(fqns[0])):
            found.add(rule.module)
    return found


def _own_forward_embeddings(plan: Plan, model: nn.Module | None) -> set[str]:
    """Vocab-parallel rules whose module writes its own ``forward`` (not ``nn.Embedding``'s):
    its code may read the weight's local tensor, so it runs on local tensors
    (``LocalVocabParallel``)."""
    if model is None:
        return set()
    found = set()
    for rule in plan.rules:
        fqns = expand_pattern(rule.module, plan.model.repeats) if rule.style == "embedding_rowwise" else []
        if fqns and type(model.get_submodule(fqns[0])).forward is not nn.Embedding.forward:
            found.add(rule.module)
    return found


def tp_mesh(device_mesh, plan: Plan):
    """The tp axis's sub-mesh; None for an expert-parallel plan with no tensor parallelism
    (tp = 1: every module but the experts stays as it is, plain tensors, whether or not the
    mesh names a tp axis of size 1)."""
    names = device_mesh.mesh_dim_names
    if plan.tp == 1 and plan.mesh.ep_axis in (names or ()):
        return None
    if device_mesh.ndim == 1:
        return device_mesh
    if not names or plan.mesh.tp_axis not in names:
        raise ValueError(f"the plan's tp axis {plan.mesh.tp_axis!r} is not in the mesh's axes {names}")
    return device_mesh[plan.mesh.tp_axis]


def check_fingerprint(model: nn.Module, plan: Plan) -> None:
    from ..plan.model import fingerprint

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


def _check_arguments(model: Any, device_mesh: Any, plan: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_plan needs an nn.Module; got {type(model).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"apply_plan needs a DeviceMesh; got {type(device_mesh).__name__}. Make one on every rank, "
                         f"e.g. init_device_mesh('cuda', (8,), mesh_dim_names=('tp',))")
    if not isinstance(plan, Plan):
        raise ValueError(f"apply_plan needs a shardplan Plan; got {type(plan).__name__} (load one with load_plan)")
    done = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if done is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized ({done!r} is a DTensor); "
                         "apply a plan once, to a model that has not been sharded")


def apply_plan(model: nn.Module, device_mesh, plan: Plan, *, check: bool = True) -> nn.Module:
    """Shard ``model`` in place on ``device_mesh`` as ``plan`` says; returns the model.

    First the ranks agree on the plan (:func:`.agree.agree`): a rank given another plan
    makes every rank raise at once instead of deadlocking in its first collective."""
    _check_arguments(model, device_mesh, plan)
    agree(plan)
    if check:
        check_fingerprint(model, plan)
        from ..plan.validate import check_findings

        for finding in check_findings(plan, model):  # a rule that matches nothing, a weight no rule covers
            warnings.warn(f"apply_plan: {finding}", stacklevel=2)
    return shard(model, device_mesh, plan)


def set_local_attributes(model: nn.Module, plan: Plan) -> None:
    """A module that sizes tensors by an integer attribute gets the value of one rank's
    shards (``num_heads / tp``): its code then views the local q/k/v by the local count."""
    for entry in plan.attributes:
        for fqn in expand_pattern(entry.module, plan.model.repeats):
            module = model.get_submodule(fqn)
            for name, value in entry.values.items():
                set_int_attribute(module, name, value)


def _local_replica(rule, module: nn.Module) -> bool:
    """A replicated module that runs on local tensors: its helper methods read its parameters
    too, called from elsewhere (JetMoE's ``experts.reduce`` adds ``self.bias``), not only its
    forward, whose hooks make them local."""
    return rule.style == "replicate" and not rule.partial_grads and not rule.param_layouts and runs_on_local_tensors(module)


def _params_of(model: nn.Module, plan: Plan, which) -> list[str]:
    """The own parameters of the modules whose rule ``which(rule, fqn)`` picks."""
    return [f"{fqn}.{n}" if fqn else n for rule in plan.rules for fqn in expand_pattern(rule.module, plan.model.repeats)
            if which(rule, fqn) for n, _ in model.get_submodule(fqn).named_parameters(recurse=False)]


def shard(model: nn.Module, device_mesh, plan: Plan) -> nn.Module:
    """The thin loop itself: ``parallelize_module`` with the plan's styles, output regions,
    re-tied weights, gradient hooks. No checks and no exchange between ranks; on a meta
    model nothing is communicated, which is how the planner's local check runs it."""
    mesh = tp_mesh(device_mesh, plan)
    if mesh is not None and mesh.size() != plan.tp:
        raise ValueError(f"the plan was made for tp={plan.tp} but the mesh's tp axis has {mesh.size()} ranks; re-plan for this mesh")
    tied = _tied_groups(model)
    _experts_over_ep(model, device_mesh, plan)
    if mesh is None:  # no tensor parallelism: only the experts are split
        _lists_over_ep(model, device_mesh, plan)
        return model
    parallelize_module(model, mesh, to_parallelize_plan(plan, model))
    set_local_attributes(model, plan)
    set_local_buffers(model, plan, rank=mesh.get_local_rank(), mesh=mesh)
    install_local_views(model, plan, rank=mesh.get_local_rank())
    read_outside = _params_of(model, plan, lambda rule, fqn: rule.style == "replicate" and (
        rule.read_outside or _local_replica(rule, model.get_submodule(fqn))))
    if read_outside:  # the code that reads them runs in the root's forward, outside any style
        local_during_forward(model, read_outside)
    split_reads = _params_of(model, plan, lambda rule, fqn: rule.read_outside and rule.style != "replicate")
    if split_reads:  # a split weight read outside its module (a tied head): that code runs on DTensors
        tied_reads(model, split_reads, mesh)
    # output regions hook in after the module's own style has turned its output local
    outputs = {r.module: _region_style(r) for r in plan.regions if r.input == "output" and not r.use_local_output}
    for rule in plan.rules:
        if rule.copy_output:
            outputs[rule.module] = combine(outputs.get(rule.module), CopyOutput())
    if outputs:
        parallelize_module(model, mesh, _fnmatch_keys(outputs))
    for group in tied:
        # re-tie to the copy a sharding style produced (a replicated or plain copy would
        # silently un-shard the other owner)
        copies = [getattr(model.get_submodule(fqn), name) for fqn, name in group]
        shared = next((c for c in copies if isinstance(c, DTensor) and not c.placements[0].is_replicate()), copies[0])
        for fqn, name in group:
            setattr(model.get_submodule(fqn), name, shared)
    # their weights see 1/tp of the tokens: Partial gradients, reduced in one bucket when backward ends
    partial_grads = [f"{fqn}.{name}" for fqn, style in plan.module_styles().items()
                     if style in ("sequence_parallel", "replicated_with_grad_allreduce")
                     for name, _ in model.get_submodule(fqn).named_parameters(recurse=False)]
    partial_grads += [f"{fqn}.{name}" for rule in plan.rules if rule.style == "colwise_kv_replicated"
                      for fqn in expand_pattern(rule.module, plan.model.repeats)
                      for name, _ in model.get_submodule(fqn).named_parameters(recurse=False)]
    partial_grads += [f"{fqn}.{name}" if fqn else name for rule in plan.rules if rule.partial_grads
                      for fqn in expand_pattern(rule.module, plan.model.repeats) for name in rule.partial_grads]
    install_gradient_sync(model, partial_grads)
    _lists_over_ep(model, device_mesh, plan)
    return model
