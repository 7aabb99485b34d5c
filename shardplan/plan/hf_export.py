"""Hugging Face export: a plan as the ``tp_plan`` dict transformers' loader applies.

Contract
--------
``to_hf_tp_plan(plan, model=None)`` (``Plan.to_hf_tp_plan``) returns ``{pattern: style}`` with
``*`` for layer indices, every rule included (``replicate`` too: transformers lays the dict
over the model's own default plan). It exports only what Hugging Face's registered styles
reproduce exactly, each with the layouts transformers gives that name, and raises
``ValueError`` naming the module and what to do for anything else (kv heads in groups,
sequence or loss parallelism, per-rank sizes, GPT-2's ``Conv1D``, fused biases, expert banks
HF cannot split). ``model`` lets it check module types and name expert weights' own keys;
plans with ``packed_colwise`` or ``moe_tp_experts`` need it. ``tests/test_hf_export_styles.py``
loads every exported style with ``from_pretrained`` on 2 gloo ranks.
"""

from __future__ import annotations

import re

from .patterns import expand_braces, matches

__all__ = ["to_hf_tp_plan", "to_hf_ep_plan"]


def to_hf_ep_plan(plan, model) -> tuple[dict[str, str], dict[str, int]]:
    """``(ep_plan, DistributedConfig keyword arguments)`` for a plan whose expert banks go
    whole over ep with no tensor parallelism: each ``ep_experts`` bank is
    ``ep_dispatch_experts`` and its parameters ``grouped_gemm`` (Hugging Face's own
    ``base_model_ep_plan`` for these models), ``ep_size`` the plan's ep and ``fsdp_size`` its
    data ranks (dense modules FSDP over dp x ep, experts over dp: ``efsdp = fsdp / ep``, as
    shardplan shards them). Anything else raises ``ValueError`` saying why."""
    if plan.mesh.ep_axis is None or not any(r.style == "ep_experts" for r in plan.rules):
        raise ValueError("this plan splits no expert bank over an ep axis; export it with to_hf_tp_plan")
    if plan.tp > 1:
        raise ValueError(f"this plan splits over {plan.mesh.ep_axis}={plan.ep} and {plan.mesh.tp_axis}={plan.tp}; "
                         "Hugging Face's expert parallelism slices each tp group's tokens instead of running tp inside "
                         f"the experts, so only plans without a tp axis export; {_APPLY}")
    listed = next((r.module for r in plan.rules if r.style == "ep_experts" and _is_list(model, r.module)), None)
    if listed is not None:
        raise ValueError(f"{listed} is a list of expert modules; Hugging Face's ep_plan splits 3-D expert banks "
                         f"(grouped_gemm) only, so this plan does not export; {_APPLY}")
    other = [r.module for r in plan.rules if r.style not in ("ep_experts", "replicate")]
    if other:
        raise ValueError(f"{other[0]} is split ({plan.rule_for(other[0]).style}) on a plan with tp=1; re-plan it")
    out: dict[str, str] = {}
    for rule in (r for r in plan.rules if r.style == "ep_experts"):
        for key in expand_braces(rule.module):
            wild = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), key)
            fqn = next(f for f, _ in model.named_modules() if matches(rule.module, f))
            for name, _ in model.get_submodule(fqn).named_parameters(recurse=False):
                out[f"{wild}.{name}"] = "grouped_gemm"
            out[wild] = "ep_dispatch_experts"
    data = 1
    for axis, n in plan.mesh.axes.items():
        data *= n if axis != plan.mesh.tp_axis else 1
    return out, {"ep_size": plan.ep, "fsdp_size": data}


def _is_list(model, pattern: str) -> bool:
    from ..analyze.graph import EXPERT_CONTAINERS

    return any(isinstance(m, EXPERT_CONTAINERS) for f, m in model.named_modules() if matches(pattern, f))


def to_hf_tp_plan(plan, model=None) -> dict[str, str]:
    """``plan`` (a :class:`~.model.Plan`, which calls this) as Hugging Face's ``tp_plan``."""
    _refuse_for_hf(plan)
    if model is None:
        need = next((r for r in plan.rules if r.style in ("packed_colwise", "moe_tp_experts")), None)
        if need is not None:
            raise ValueError(
                f"{need.module}: exporting {need.style} needs the model, to check the module's layout and name "
                "its weights' keys: call plan.to_hf_tp_plan(model) (a meta-device build of the model will do)")
    kinds = _hf_module_checks(plan, model) if model is not None else None
    # every rule, "replicate" too: transformers lays this dict over the model's own default
    # plan, so a module left out would take HF's default style, not shardplan's; its keys
    # name layers by "*" (layers.0.mlp would "match nothing"), one style per such name
    out: dict[str, str] = {}
    for rule in plan.rules:
        for key in expand_braces(rule.module):
            wild = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), key)
            entries = {wild: rule.style}
            if rule.style == "moe_tp_experts" and kinds is not None:
                # transformers' moe_tp_experts only sums the experts' partial outputs: the bank's
                # weights are split by their own keys (up [E, X, H] on X, down [E, H, I] on I)
                for param, style in kinds.get(rule.module, {}).items():
                    entries[f"{wild}.{param}" if wild else param] = style
            for name, style in entries.items():
                if out.setdefault(name, style) != style:
                    raise ValueError(
                        f"{name}: layers of this stack take different styles ({out[name]} and {style}), which "
                        "Hugging Face's tp_plan cannot express (one style per name, the layer index written *); "
                        "apply the plan with shardplan.apply_plan instead")
    return out


# shardplan style -> the (input, output) activation layouts of Hugging Face's style of that
# name (transformers.distributed.tensor_parallel's registry); None: any layout the rule may
# leave unset, i.e. shardplan's default, which is the same
_HF_LAYOUTS: dict[str, tuple[frozenset, frozenset]] = {
    "colwise": (frozenset({None, "Replicate"}), frozenset({None})),
    "colwise_gather_output": (frozenset({None, "Replicate"}), frozenset({None, "Replicate"})),
    "rowwise": (frozenset({None, "Shard(-1)", "Shard(2)"}), frozenset({None, "Replicate"})),
    "rowwise_split_input": (frozenset({None, "Replicate"}), frozenset({None, "Replicate"})),
    "embedding_rowwise": (frozenset({None, "Replicate"}), frozenset({None, "Replicate"})),
    "packed_colwise": (frozenset({None, "Replicate"}), frozenset({None})),
    "moe_tp_experts": (frozenset({None}), frozenset({None})),
    "replicate": (frozenset({None}), frozenset({None})),
}
_HF_SPLITS_LINEAR = {"colwise": "out_features", "colwise_gather_output": "out_features", "packed_colwise": "out_features",
                     "rowwise": "in_features", "rowwise_split_input": "in_features"}
_APPLY = "apply the plan with shardplan.apply_plan instead"


def _refuse_for_hf(plan) -> None:
    """What Hugging Face's ``tp_plan`` cannot express, whatever the model: raise ValueError."""
    alien = [r.module for r in plan.rules
             if r.style in ("colwise_kv_replicated", "colwise_kv_gathered", "attention_heads")
             or r.output_grad_partial or r.input_grad_partial]
    if alien:
        raise ValueError(
            f"{alien[0]} (and {len(alien) - 1} more) use styles Hugging Face's tp_plan cannot express "
            "(kv heads replicated in groups, torch's nn.MultiheadAttention split by heads, one kv head or MLA's "
            "latent whole with a partial gradient); apply the plan with "
            "shardplan.apply_plan instead, or plan for a tp that divides the kv heads")
    whole = next((r for r in plan.rules if r.style == "moe_whole_experts"), None)
    if whole is not None:
        raise ValueError(
            f"{whole.module}: moe_whole_experts (whole experts on each tp rank, their partial sums all-reduced) has no "
            "style in Hugging Face's tp_plan (its all-reduce expert parallelism is an ep_plan on an ep group equal to "
            "the tp group); for a tp_plan, plan it split inside every expert: shardplan.price_styles(model, mesh, "
            f"{{{whole.module!r}: 'moe_tp_experts'}}), or "
            f"{_APPLY}")
    sharded_out = [r for r in plan.rules if r.style == "colwise" and r.output_layouts is not None]
    if sharded_out:
        # loss_parallel keeps the head's logits vocab-sharded; Hugging Face's "colwise" would
        # hand each rank its own part of the vocabulary as if it were all of it
        raise ValueError(
            f"{sharded_out[0].module} keeps its output sharded ({sharded_out[0].output_layouts}: "
            "loss_parallel), which Hugging Face's tp_plan cannot express (each rank's logits would cover part of "
            "the vocabulary); plan with loss_parallel=False for Hugging Face, or apply it with shardplan.apply_plan")
    seq = [r for r in plan.rules if r.style == "sequence_parallel" or "Shard(1)" in (r.input_layouts, r.output_layouts)]
    if seq:
        r = seq[0]
        raise ValueError(
            f"{r.module}: {r.style} with activations split on the sequence (sequence_parallel), which Hugging Face's "
            "tp_plan cannot express (its rowwise and embedding_rowwise always all-reduce to Replicate); plan with "
            f"sequence_parallel=False for Hugging Face, or {_APPLY}")
    cut = [g for g in plan.regions if g.is_slice]
    if cut:
        # the region is what hands the module its rank's part of a whole bias (ALiBi) to add to
        # scores split by heads; Hugging Face's tp_plan has no such entry, so its ranks would
        # add the whole bias to their heads' scores
        raise ValueError(f"{cut[0].module}: its input {cut[0].input!r} is cut to each rank's heads where it is "
                         f"received ({cut[0].desired_input_layouts}), which Hugging Face's tp_plan cannot express; {_APPLY}")
    for r in plan.rules:
        accept = _HF_LAYOUTS.get(r.style)
        if r.style == "replicated_with_grad_allreduce":  # a no-op forward on whatever local tensor arrives
            accept = (frozenset({r.input_layouts}), frozenset({None}))
        if accept is None:
            raise ValueError(f"{r.module}: style {r.style!r} has no Hugging Face tp_plan counterpart; {_APPLY}")
        if r.input_layouts not in accept[0] or r.output_layouts not in accept[1]:
            raise ValueError(
                f"{r.module}: {r.style} with input {r.input_layouts or 'default'} / output {r.output_layouts or 'default'}, "
                f"layouts Hugging Face's {r.style!r} does not have (it takes {_layouts(accept[0])} in, gives "
                f"{_layouts(accept[1])} out); {_APPLY}")
        if r.whole_parts:
            raise ValueError(
                f"{r.module}: packed_colwise with its last {r.whole_parts} part(s) gathered whole (one kv head fused "
                f"after the query heads); Hugging Face's styles have no such layout; {_APPLY}")
        if r.style == "packed_colwise" and (r.packed or 2) != 2:
            raise ValueError(
                f"{r.module}: packed_colwise of {r.packed} fused parts; Hugging Face's packed_colwise splits two "
                f"([gate; up]), so each rank would get the wrong rows; {_APPLY}, or pin it to colwise_gather_output")
        if r.param_layouts or r.partial_grads:
            what = (f"its own parameters split ({r.param_layouts})" if r.param_layouts
                    else f"partial gradients of its own parameters ({r.partial_grads})")
            raise ValueError(f"{r.module}: {r.style} with {what}, which Hugging Face's {r.style!r} does not do; {_APPLY}")
    if plan.attributes or plan.buffers or plan.local_views:
        fix = (plan.attributes or plan.buffers or plan.local_views)[0]
        what = (f"sizes {fix.values}" if plan.attributes else f"buffer shards {fix.layouts}" if plan.buffers
                else "views and cuts")
        raise ValueError(
            f"{fix.module}: the plan gives its code per-rank {what} that shardplan sets when applying, and Hugging "
            f"Face's loader does not (its forward would see global sizes on one rank's shards); {_APPLY}")


def _layouts(accepted: frozenset) -> str:
    return " or ".join(sorted(x or "default" for x in accepted))


def _hf_module_checks(plan, model) -> dict[str, dict[str, str]]:
    """Check each ruled module of ``model`` against what Hugging Face's style of that name
    handles (ValueError otherwise); return, per moe_tp_experts rule, the keys its expert
    weights take (parameter name -> HF style)."""
    from torch import nn

    from ..analyze.graph import expert_params, module_kind

    modules = [(fqn, mod) for fqn, mod in model.named_modules() if fqn]
    experts: dict[str, dict[str, str]] = {}
    for rule in plan.rules:
        for fqn, mod in modules:
            if not matches(rule.module, fqn):
                continue
            kind, name = module_kind(mod), type(mod).__name__
            if kind == "conv1d" and rule.style != "replicate":
                raise ValueError(
                    f"{fqn}: {rule.style} of a Conv1D (weight [in, out]); Hugging Face's tp_plan styles split only "
                    f"nn.Linear's [out, in] layout, so none splits this weight right; {_APPLY}")
            attr = _HF_SPLITS_LINEAR.get(rule.style)
            if attr is not None and not hasattr(mod, attr):
                raise ValueError(
                    f"{fqn}: {rule.style} of a {name}, which has no `{attr}`: Hugging Face's {rule.style!r} splits "
                    f"nn.Linear only; {_APPLY}")
            if rule.style == "packed_colwise" and getattr(mod, "bias", None) is not None:
                raise ValueError(
                    f"{fqn}: packed_colwise of a fused projection with a bias; Hugging Face's packed_colwise splits "
                    f"the bias in contiguous halves, not [gate_r; up_r] as the weight; {_APPLY}")
            if rule.style == "embedding_rowwise" and not isinstance(mod, nn.Embedding):
                raise ValueError(f"{fqn}: embedding_rowwise of a {name}, not an nn.Embedding; {_APPLY}")
            if rule.style == "moe_tp_experts":
                ep = expert_params(mod)
                if ep is None or ep.gate or ep.interleaved or ep.up_bias or ep.down_bias or (ep.up_dim, ep.down_dim) != (1, 2):
                    raise ValueError(
                        f"{fqn}: moe_tp_experts of a bank Hugging Face cannot split so (it splits up [E, X, H] on X "
                        "and down [E, H, I] on I, no biases, gate and up packed as [gate; up]); " + _APPLY)
                keys = {ep.up: "packed_colwise" if ep.packed else "colwise", ep.down: "rowwise"}
                if experts.setdefault(rule.module, keys) != keys:
                    raise ValueError(f"{rule.module}: expert banks of different layouts under one rule; {_APPLY}")
    missing = [r.module for r in plan.rules if r.style in ("packed_colwise", "moe_tp_experts")
               and not any(matches(r.module, fqn) for fqn, _ in modules)]
    if missing:
        raise ValueError(f"{missing[0]}: the plan's module is not in the model given; pass the model it was planned for")
    return experts
