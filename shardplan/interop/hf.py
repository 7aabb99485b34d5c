"""Hugging Face ``tp_plan`` interop: read a model's own plan, convert in both directions, compare.

Contract
--------
``transformers`` is optional: nothing here imports it at module import time (``import
shardplan`` and ``import shardplan.interop.hf`` never load it). The functions that need it import it
lazily through :mod:`shardplan.interop.hf_models`, which sets ``HF_HUB_OFFLINE=1`` first, so nothing is
ever downloaded; models are built from configs only.

* :data:`STYLE_FAMILY` maps every Hugging Face ``tp_plan`` style name (the
  ``ALL_PARALLEL_STYLES`` registry of ``transformers.distributed``, older names included)
  and every shardplan style name to one of four families: ``"colwise"`` (weight split on
  its output features), ``"rowwise"`` (split on its input features / vocab-parallel
  embeddings), ``"replicate"`` (whole weight on every rank: replicated, sequence parallel,
  replicated-with-grad-all-reduce, local...) and ``"experts"`` (MoE expert sharding).
* ``hf_tp_plan(model)`` is the plan Hugging Face itself applies to this model instance, with
  keys as ``model.named_modules()`` spells them (``*`` for layer indices): each base model's
  ``config.base_model_tp_plan`` under its prefix (sub-configs such as ``text_config`` come in
  through the sub-models that own them), each class's ``_tp_plan`` (heads: ``lm_head``) and
  the vocab-parallel ``embed_tokens`` rule ``transformers`` adds; merged with the instance's
  resolved ``model.tp_plan`` where ``transformers`` provides one.
* ``from_hf_tp_plan(mapping, *, model, mesh)`` prices such a plan: every mapped module is
  pinned to the corresponding shardplan style with :func:`shardplan.price_styles` and, as
  Hugging Face does, every weight module the mapping does not name is pinned to
  ``replicate`` (``fill=None`` lets the planner choose those instead). Styles shardplan
  cannot express (:data:`UNSUPPORTED_HF_STYLES`, e.g. ``mla_kv_a_proj``, ``embedding_colwise``,
  ``all_reduce``; every HF name that is also in ``shardplan.plan.STYLES`` maps to itself) and
  keys naming parameters rather than modules (except HF's per-parameter halves of a module
  it also styles, such as an expert bank's ``gate_up_proj``/``down_proj``) raise ``ValueError`` saying which keys and what to do, unless
  ``skip_unsupported=True`` (then they are left to ``fill`` and listed in the plan's
  warnings). Keys matching no module are listed in the plan's warnings, as Hugging Face
  logs unused rules.
* ``to_hf_tp_plan(plan, model=None)`` is the reverse (``Plan.to_hf_tp_plan``).
* ``agreement(model, plan)`` lists, for every Linear-like weight module (Linear, HF Conv1D,
  Embedding, and modules HF shards as MoE experts) that the HF plan covers, ``(fqn,
  hf_style, our_style, same_family, reason)``; ``reason`` is empty where the families
  agree, else the plan's own account: the decision's alternatives (``plan.explain``, present
  when planned with ``explain=True``), the rule's ``why`` and the plan's warnings naming the
  module.
* ``build_hf_model``, ``shrink_config`` and ``positional`` (building models from configs) live in
  :mod:`shardplan.interop.hf_models` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from torch import nn

from ..plan.model import STYLES, Plan, expand_pattern, matches
from .hf_models import TINY, build_hf_model, positional, shrink_config

__all__ = [
    "STYLE_FAMILY", "HF_TO_SHARDPLAN", "UNSUPPORTED_HF_STYLES", "style_family", "hf_tp_plan",
    "from_hf_tp_plan", "to_hf_tp_plan", "hf_ep_plan", "from_hf_ep_plan", "agreement", "Agreement", "weight_kind", "build_hf_model",
    "shrink_config", "positional", "hf_weight_counts", "TINY",
]

# --------------------------------------------------------------------------- style vocabulary

STYLE_FAMILY: dict[str, str] = {
    # column-parallel: the weight is split on its output features
    "colwise": "colwise",
    "colwise_gather_output": "colwise",
    "colwise_rep": "colwise",
    "packed_colwise": "colwise",
    "colwise_kv_replicated": "colwise",
    "colwise_kv_gathered": "colwise",
    "attention_heads": "colwise",  # shardplan's: nn.MultiheadAttention's packed in_proj by heads
    "dtensor_weights": "colwise",
    "listed_heads": "colwise",  # shardplan's: a list of head modules split whole over tp  # shardplan's: a module's raw weights, its first products split by heads
    "local_colwise": "colwise",
    "local_packed_colwise": "colwise",
    "embedding_colwise": "colwise",  # embedding table split on the hidden dim (output features)
    "norm_sharded": "colwise",  # shardplan's: a norm over features split tp ways, its weight split with them
    # row-parallel: split on the input features; vocab-parallel embeddings split on the rows
    "rowwise": "rowwise",
    "rowwise_split_input": "rowwise",
    "rowwise_rep": "rowwise",
    "packed_rowwise": "rowwise",
    "local_rowwise": "rowwise",
    "local_packed_rowwise": "rowwise",
    "embedding_rowwise": "rowwise",
    "isolated": "rowwise",  # old name: rowwise on an isolated input
    # the whole weight on every rank
    "replicate": "replicate",
    "sequence_parallel": "replicate",
    "replicated_with_grad_allreduce": "replicate",
    "local": "replicate",
    "local_params": "replicate",
    "gather": "replicate",
    "all_reduce": "replicate",
    "mla_kv_a_proj": "replicate",
    "moe_identity_expert": "replicate",
    # mixture of experts: each rank holds a slice of every expert (or whole experts)
    "moe_tp_experts": "experts",
    "moe_whole_experts": "experts",
    "ep_experts": "experts",
    "grouped_gemm": "experts",
    "ep_dispatch_experts": "experts",
    "ep_router": "experts",
}

# Hugging Face style -> the shardplan style with the same layouts: every name the two share
# (whatever shardplan.plan.STYLES holds), plus HF's aliases of shardplan styles.
HF_TO_SHARDPLAN: dict[str, str] = {
    **{s: s for s in STYLES if s in STYLE_FAMILY},
    "colwise_rep": "colwise_gather_output",  # Replicate in, Replicate out: the same layouts
    "rowwise_rep": "rowwise_split_input",  # Replicate in (sliced locally), Replicate out
}

_UNSUPPORTED_HINTS: dict[str, str] = {
    "packed_colwise": "a fused gate/up weight split with a stride; shardplan has no strided shard: "
                      "unfuse the projection or pin the module to colwise_gather_output",
    "packed_rowwise": "the down half of a packed pair; pin its module to rowwise or leave it to the planner",
    "moe_tp_experts": "expert tensor parallelism, which this shardplan cannot express: leave the experts "
                      "replicated (drop the key) or shard them with transformers' own tp_plan",
    "grouped_gemm": "expert parallelism, an ep_plan entry: plan on a mesh with an 'ep' axis (experts over ep) "
                    "and drop the key here",
    "ep_dispatch_experts": "expert parallelism, an ep_plan entry: plan on a mesh with an 'ep' axis (experts over "
                           "ep) and drop the key here",
    "ep_router": "expert parallelism; drop the key (experts stay replicated)",
    "moe_identity_expert": "an MoE helper for moe_tp_experts; drop the key",
    "mla_kv_a_proj": "DeepSeek MLA's split all-reduce; pin the module to replicate or leave it to the planner",
    "embedding_colwise": "an embedding split on the hidden dim; use embedding_rowwise (vocab-parallel) or drop the key",
    "all_reduce": "a bare output all-reduce of a module that computes a partial sum; drop the key",
    "local_params": "runs a module on local shards of its own parameters; drop the key",
    "local_colwise": "local (non-DTensor) colwise; use colwise",
    "local_rowwise": "local (non-DTensor) rowwise; use rowwise",
    "local_packed_colwise": "a fused weight split with a stride; unfuse it or use colwise_gather_output",
    "local_packed_rowwise": "the down half of a packed pair; use rowwise",
    "local": "keeps a module's parameters local; use replicate",
    "gather": "an output all-gather hook; drop the key",
    "isolated": "old rowwise variant; use rowwise_split_input",
}

# Hugging Face styles with no shardplan counterpart -> what to do instead.
UNSUPPORTED_HF_STYLES: dict[str, str] = {k: v for k, v in _UNSUPPORTED_HINTS.items() if k not in HF_TO_SHARDPLAN}


def style_family(style: str | None) -> str | None:
    """The family of a Hugging Face or shardplan style name; ``None`` for an unknown name."""
    return None if style is None else STYLE_FAMILY.get(style)


def to_hf_tp_plan(plan: Plan, model: nn.Module | None = None) -> dict[str, str]:
    """The plan as a Hugging Face ``tp_plan`` mapping (``Plan.to_hf_tp_plan``; ``model`` lets it
    check module types, and is needed for packed_colwise and moe_tp_experts)."""
    from ..plan.hf_export import to_hf_tp_plan as export

    return export(plan, model)


# --------------------------------------------------------------------------- reading HF's plan


def _is_base_model(module: nn.Module) -> bool:
    prefix = getattr(type(module), "base_model_prefix", None)
    if not hasattr(module, "config") or prefix is None:
        return False
    return getattr(module, prefix, module) is module if prefix else True


def _prefixed(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """Hugging Face's tensor-parallel plan of ``model``, keys as its ``named_modules`` (see module doc)."""
    plan: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        cls_plan = getattr(type(mod), "_tp_plan", None)
        config = getattr(mod, "config", None)
        base_plan = {}
        if config is not None and _is_base_model(mod):
            base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
            if base_plan and isinstance(getattr(mod, "embed_tokens", None), nn.Embedding):
                base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
        for key, style in {**(cls_plan if isinstance(cls_plan, Mapping) else {}), **base_plan}.items():
            plan.setdefault(_prefixed(fqn, key), style)
    resolved = getattr(model, "_tp_plan", None)  # transformers' own merge, on PreTrainedModel instances
    if isinstance(resolved, Mapping):
        for key, style in resolved.items():
            plan.setdefault(key, style)
    return plan


# --------------------------------------------------------------------------- HF plan -> Plan


def _weight_leaves(model: nn.Module) -> list[str]:
    from ..analyze.trace import is_weight_leaf

    return [fqn for fqn, mod in model.named_modules() if fqn and is_weight_leaf(mod)]


def _param_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


def _generic(fqn: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def from_hf_tp_plan(
    mapping: Mapping[str, str], *, model: nn.Module, mesh: Any, example_inputs: tuple | None = None,
    example_kwargs: dict | None = None, fill: str | None = "replicate", skip_unsupported: bool = False,
    **options: Any,
) -> Plan:
    """A shardplan :class:`Plan` that applies ``mapping`` (an HF ``tp_plan``), priced by the cost model."""
    from ..api import price_styles

    modules = dict(model.named_modules())
    params = _param_names(model)
    module_keys = {k for k in mapping if any(matches(k, m) for m in modules)}
    problems: list[str] = []
    pinned: dict[str, str] = {}
    for key, style in mapping.items():
        if key not in module_keys and any(matches(key, p) for p in params):
            owner = key.rpartition(".")[0]
            if any(matches(k, m) for k in module_keys for m in modules if matches(owner, m)):
                continue  # HF's per-parameter half of an owner's style (experts' gate_up_proj, down_proj)
            problems.append(
                f"{key!r}: {style!r} names a parameter, not a module; shardplan pins modules: pin its owner "
                f"{owner!r} or drop the key"
            )
            continue
        if style not in HF_TO_SHARDPLAN:
            hint = UNSUPPORTED_HF_STYLES.get(style, f"unknown style; expected one of {sorted(HF_TO_SHARDPLAN)}")
            problems.append(f"{key!r}: {style!r} ({hint})")
            continue
        pinned[key] = HF_TO_SHARDPLAN[style]
    if problems and not skip_unsupported:
        raise ValueError(
            "this tp_plan has entries shardplan cannot express:\n  " + "\n  ".join(problems)
            + "\n(pass skip_unsupported=True to leave those modules to fill= and list them in the plan's warnings)"
        )
    unused = [k for k in pinned if k not in module_keys]
    pinned = {k: v for k, v in pinned.items() if k in module_keys}  # HF ignores unused keys; so do we
    if fill is not None:
        for fqn in _weight_leaves(model):
            if not any(matches(k, fqn) for k in pinned):
                pinned.setdefault(_generic(fqn), fill)
    plan = price_styles(model, mesh, pinned, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    notes = [f"tp_plan entry not applied: {p}" for p in problems]
    notes += [f"tp_plan key {k!r} matches no module of {type(model).__name__}; ignored" for k in unused]
    return plan.model_copy(update={"warnings": plan.warnings + notes}) if notes else plan


# --------------------------------------------------------------------------- HF ep_plan -> Plan

# transformers' expert-parallel styles (distributed/expert_parallel.py): the bank's dispatch,
# its parameters' shards, the router left whole
_EP_BANK, _EP_PARAM, _EP_ROUTER = "ep_dispatch_experts", "grouped_gemm", "ep_router"


def hf_ep_plan(model: nn.Module) -> dict[str, str]:
    """Hugging Face's expert-parallel plan of ``model`` (its config's ``base_model_ep_plan``),
    keys as its ``named_modules``; empty for a model without one."""
    for fqn, mod in model.named_modules():
        config = getattr(mod, "config", None)
        if config is not None and _is_base_model(mod):
            return {_prefixed(fqn, k): v for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items()}
    return {}


def from_hf_ep_plan(mapping: Mapping[str, str] | None = None, *, model: nn.Module, mesh: Any,
                    example_inputs: tuple | None = None, example_kwargs: dict | None = None, **options: Any) -> Plan:
    """A shardplan :class:`Plan` that splits the banks ``mapping`` (an HF ``ep_plan``; default
    :func:`hf_ep_plan`) names ``ep_dispatch_experts`` by whole experts over the mesh's ep axis
    and keeps every other weight whole, as transformers' expert parallelism does; priced by
    the cost model (:func:`~shardplan.api.price_styles`). ``ValueError`` for a mesh without an
    ep axis or with tp, a style that is not one of HF's expert-parallel styles, or a named bank
    shardplan cannot split over ep."""
    from ..api import price_styles
    from ..decide.axes import expert_axis, tp_axis_of

    mapping = dict(hf_ep_plan(model) if mapping is None else mapping)
    axes = dict(mesh) if isinstance(mesh, Mapping) else {"tp": int(mesh)}
    tp = tp_axis_of(axes, options.get("tp_axis"))
    if expert_axis(axes, tp) is None or axes.get(tp or "", 1) > 1:
        raise ValueError(f"an ep_plan splits experts over an ep axis with no tensor parallelism; got mesh {axes}: "
                         "give one like {'ep': 8} or {'dp': 2, 'ep': 4}")
    odd = {k: v for k, v in mapping.items() if v not in (_EP_BANK, _EP_PARAM, _EP_ROUTER)}
    if odd:
        raise ValueError(f"ep_plan entries {odd} are not expert-parallel styles ({_EP_BANK}, {_EP_PARAM}, {_EP_ROUTER}); "
                         "import tensor-parallel entries with from_hf_tp_plan")
    banks = [k for k, v in mapping.items() if v == _EP_BANK]
    whole = {_generic(f): "replicate" for f in _weight_leaves(model) if not any(matches(k, f) for k in banks)}
    plan = price_styles(model, axes, whole, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    split = [r.module for r in plan.rules if r.style == "ep_experts"]
    missing = [k for k in banks if any(matches(k, f) for f, _ in model.named_modules())
               and not any(matches(k, f) for r in split for f in expand_pattern(r, plan.model.repeats))]
    if missing:
        raise ValueError(f"ep_plan names {missing[0]} {_EP_BANK}, but shardplan cannot split it over ep (see "
                         "shardplan plan --mesh ep=N for why); drop the key to keep it whole")
    return plan


# --------------------------------------------------------------------------- agreement


class Agreement(NamedTuple):
    fqn: str
    hf_style: str
    our_style: str
    same_family: bool
    reason: str


def weight_kind(module: nn.Module) -> str:
    """``"linear"`` (nn.Linear or HF Conv1D), ``"embedding"``, ``"experts"`` (a bank of 3-D
    expert weights, as the core recognizes it) or ``"other"``."""
    from ..analyze.graph import module_kind

    kind = module_kind(module)
    return {"linear": "linear", "conv1d": "linear", "embedding": "embedding", "experts": "experts"}.get(kind, "other")


def _hf_style_for(fqn: str, hf: Mapping[str, str], owned: list[str]) -> str | None:
    if fqn in hf:
        return hf[fqn]
    hit = next((s for k, s in hf.items() if matches(k, fqn)), None)
    if hit is not None:
        return hit
    for pname in owned:  # a parameter-level key (``...experts.down_proj``) styles its owner
        full = f"{fqn}.{pname}" if fqn else pname
        hit = next((s for k, s in hf.items() if k == full or matches(k, full)), None)
        if hit is not None:
            return hit
    return None


def _reason(plan: Plan, fqn: str, hf_style: str) -> str:
    parts: list[str] = []
    try:
        d = plan.explain(fqn)
    except ValueError:
        d = None
    if d is not None:
        want = HF_TO_SHARDPLAN.get(hf_style)
        alts = [a for a in d.alternatives if a.style == want] or [
            a for a in d.alternatives if style_family(a.style) == style_family(hf_style)
        ]
        for a in alts:
            if a.step_time_s is None:
                parts.append(f"{a.style} infeasible: {a.reason or 'no consistent plan'}")
            else:
                dt = a.step_time_s - d.step_time_s
                dm = (a.param_bytes_per_device or 0.0) - d.param_bytes_per_device
                parts.append(f"{a.style}: step time {dt:+.3g} s, params {dm / 2**20:+.4g} MiB/device vs the chosen {d.style}")
    rule = plan.rule_for(fqn)
    if rule is not None and rule.why and not parts:
        parts.append(rule.why)
    for w in plan.warnings:
        name = w.split(": ", 1)[0]
        if matches(name, fqn) or name == fqn:
            parts.append(w)
    return "; ".join(parts)


def agreement(model: nn.Module, plan: Plan, hf_plan: Mapping[str, str] | None = None) -> list[Agreement]:
    """HF style vs the plan's style for every Linear-like weight module HF's plan covers."""
    hf = dict(hf_tp_plan(model) if hf_plan is None else hf_plan)
    if not hf:
        return []
    ours = plan.module_styles()
    rows = []
    for fqn, mod in model.named_modules():
        if not fqn:
            continue
        owned = [n for n, _ in mod.named_parameters(recurse=False)]
        if not owned:
            continue
        hf_style = _hf_style_for(fqn, hf, owned)
        if hf_style is None:
            continue
        if weight_kind(mod) == "other" and style_family(hf_style) != "experts":
            continue  # norms, routers, biases: not Linear-like
        our = ours.get(fqn)
        if our is None:
            rule = plan.rule_for(fqn)
            our = rule.style if rule is not None else "(no rule)"
        same = style_family(hf_style) is not None and style_family(hf_style) == style_family(our)
        reason = "" if same else (_reason(plan, fqn, hf_style) if our != "(no rule)" else "no rule in the plan covers it")
        rows.append(Agreement(fqn, hf_style, our, same, reason))
    return rows


def hf_weight_counts(model: nn.Module, rows: list[Agreement]) -> dict[str, float]:
    """Modules and parameter counts behind ``rows`` (agreeing and total), for summaries."""
    out = {"modules": 0, "modules_same": 0, "params": 0, "params_same": 0}
    for row in rows:
        n = sum(p.numel() for p in model.get_submodule(row.fqn).parameters(recurse=False))
        out["modules"] += 1
        out["params"] += n
        if row.same_family:
            out["modules_same"] += 1
            out["params_same"] += n
    return out

