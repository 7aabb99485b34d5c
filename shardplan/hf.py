"""Hugging Face ``tp_plan`` interop: read a model's own plan, convert in both directions, compare.

Contract
--------
``transformers`` is optional: nothing here imports it at module import time (``import
shardplan`` and ``import shardplan.hf`` never load it). The functions that need it import it
lazily through :mod:`shardplan.sources`, which sets ``HF_HUB_OFFLINE=1`` first, so nothing is
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
* ``to_hf_tp_plan(plan)`` is the reverse (``Plan.to_hf_tp_plan``).
* ``agreement(model, plan)`` lists, for every Linear-like weight module (Linear, HF Conv1D,
  Embedding, and modules HF shards as MoE experts) that the HF plan covers, ``(fqn,
  hf_style, our_style, same_family, reason)``; ``reason`` is empty where the families
  agree, else the plan's own account: the decision's alternatives (``plan.explain``, present
  when planned with ``explain=True``), the rule's ``why`` and the plan's warnings naming the
  module.
* ``build_hf_model(model_type, *, tiny=False, device="meta", seed=None)`` returns ``(model,
  example_inputs, example_kwargs)`` built from ``AutoConfig.for_model(model_type)``
  (``AutoModelForCausalLM``, else ``AutoModel``) with ``use_cache=False``. ``tiny=True``
  shrinks the config to hidden 64, 2 layers, 4 heads (2 KV heads), intermediate 128, vocab
  512, head_dim 16, 128 positions, 4 experts (2 per token), 32x32 images of 8x8 patches,
  dropout 0, token ids inside the vocabulary, per-layer lists resized. Inputs: token ids
  ``(batch_size, seq_len)`` (default 2 x 16), ``pixel_values`` for vision models,
  ``decoder_input_ids`` as a keyword for encoder-decoders. With a ``seed`` (which seeds
  torch's global RNG before the build) the weights and inputs are deterministic; off the meta
  device the model is float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .plan import STYLES, Plan, matches

__all__ = [
    "STYLE_FAMILY", "HF_TO_SHARDPLAN", "UNSUPPORTED_HF_STYLES", "style_family", "hf_tp_plan",
    "from_hf_tp_plan", "to_hf_tp_plan", "agreement", "Agreement", "weight_kind", "build_hf_model",
    "shrink_config", "positional", "hf_weight_counts", "TINY",
]

# --------------------------------------------------------------------------- style vocabulary

STYLE_FAMILY: dict[str, str] = {
    # column-parallel: the weight is split on its output features
    "colwise": "colwise",
    "colwise_gather_output": "colwise",
    "colwise_rep": "colwise",
    "packed_colwise": "colwise",
    "local_colwise": "colwise",
    "local_packed_colwise": "colwise",
    "embedding_colwise": "colwise",  # embedding table split on the hidden dim (output features)
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
    "grouped_gemm": "expert parallelism; drop the key (experts stay replicated)",
    "ep_dispatch_experts": "expert parallelism; drop the key (experts stay replicated)",
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


def to_hf_tp_plan(plan: Plan) -> dict[str, str]:
    """The plan as a Hugging Face ``tp_plan`` mapping (``Plan.to_hf_tp_plan``)."""
    return plan.to_hf_tp_plan()


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
    from .trace import is_weight_leaf

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
    from .api import price_styles

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
    if fill is not None:
        for fqn in _weight_leaves(model):
            if not any(matches(k, fqn) for k in pinned):
                pinned.setdefault(_generic(fqn), fill)
    plan = price_styles(model, mesh, pinned, example_inputs=example_inputs, example_kwargs=example_kwargs, **options)
    notes = [f"tp_plan entry not applied: {p}" for p in problems]
    notes += [f"tp_plan key {k!r} matches no module of {type(model).__name__}; ignored" for k in unused]
    return plan.model_copy(update={"warnings": plan.warnings + notes}) if notes else plan


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
    from .graph import module_kind

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


# --------------------------------------------------------------------------- building models

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
        "head_dim": 16, "positions": 128, "experts": 4, "experts_per_tok": 2, "image": 32, "patch": 8}

_SIZES: list[tuple[tuple[str, ...], str]] = [
    (("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim"), "hidden"),
    (("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "n_layers", "num_encoder_layers"), "layers"),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads"), "heads"),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), "kv_heads"),
    (("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
      "moe_intermediate_size", "shared_expert_intermediate_size"), "intermediate"),
    (("vocab_size",), "vocab"),
    (("head_dim", "d_kv", "kv_channels"), "head_dim"),
    (("max_position_embeddings", "n_positions", "n_ctx", "original_max_position_embeddings"), "positions"),
    (("num_local_experts", "num_experts", "n_routed_experts"), "experts"),
    (("image_size",), "image"),
    (("patch_size",), "patch"),
]
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
              "cls_token_id", "mask_token_id")


def _has(config: Any, name: str) -> bool:
    try:
        return name in config.to_dict() or name in getattr(config, "attribute_map", {})
    except Exception:  # noqa: BLE001 - an exotic config: fall back to attribute lookup
        return hasattr(config, name)


def _set(config: Any, name: str, value: Any) -> None:
    """setattr only where the attribute exists and takes the value."""
    if not _has(config, name):
        return
    try:
        setattr(config, name, value)
    except Exception:  # noqa: BLE001 - read-only property or a validator that refuses it
        pass


def shrink_config(config: Any, sizes: Mapping[str, int] = TINY) -> Any:
    """Shrink ``config`` (and its sub-configs) in place to the tiny sizes; returns it."""
    for names, key in _SIZES:
        for name in names:
            if not _has(config, name):
                continue
            current = getattr(config, name, None)
            if current is None and key in ("kv_heads", "head_dim", "intermediate"):
                continue  # derived from the others when unset
            if isinstance(current, (list, tuple)) and key in ("image", "patch"):
                _set(config, name, type(current)([sizes[key]] * len(current)))
            elif not isinstance(current, bool) and (current is None or isinstance(current, int)):
                _set(config, name, sizes[key])
    k = getattr(config, "num_experts_per_tok", None)
    if isinstance(k, int) and _has(config, "num_experts_per_tok"):
        _set(config, "num_experts_per_tok", min(k, sizes["experts_per_tok"]))
    if _has(config, "topk_group") and isinstance(getattr(config, "topk_group", None), int):
        _set(config, "topk_group", 1)
        _set(config, "n_group", 1)
    layers = sizes["layers"]
    for name in ("layer_types", "mlp_only_layers", "max_window_layers", "first_k_dense_replace"):
        if not _has(config, name):
            continue
        value = getattr(config, name, None)
        if name == "layer_types" and isinstance(value, (list, tuple)) and value:
            _set(config, name, [value[i % len(value)] for i in range(layers)])
        elif name == "mlp_only_layers" and isinstance(value, (list, tuple)):
            _set(config, name, [i for i in value if i < layers])
        elif isinstance(value, int) and not isinstance(value, bool):
            _set(config, name, min(value, layers))
    for name, value in list(config.to_dict().items()):
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            _set(config, name, 0.0)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for name in _TOKEN_IDS:
            value = getattr(config, name, None) if _has(config, name) else None
            if isinstance(value, int) and value >= vocab:
                _set(config, name, vocab - 1)
            elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
                _set(config, name, [min(v, vocab - 1) for v in value])
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink_config(sub, sizes)
    return config


def _example_inputs(model: nn.Module, config: Any, *, device: Any, batch_size: int, seq_len: int,
                    seed: int | None) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    meta = torch.device(device).type == "meta"
    forward_params = _forward_params(model)

    def ids(shape: tuple[int, ...], high: int) -> torch.Tensor:
        if meta:
            return torch.zeros(shape, dtype=torch.long, device="meta")
        return torch.randint(0, high, shape, generator=gen).to(device)

    image = getattr(config, "image_size", None)
    if "pixel_values" in forward_params and "input_ids" not in forward_params and image is not None:
        image = image[0] if isinstance(image, (list, tuple)) else image
        channels = getattr(config, "num_channels", 3)
        shape = (batch_size, channels, image, image)
        x = torch.zeros(shape, device="meta") if meta else torch.randn(shape, generator=gen).to(device)
        return (x,), {}
    vocab = getattr(config, "vocab_size", None) or 2
    inputs = (ids((batch_size, seq_len), vocab),)
    kwargs = {}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in forward_params:
        kwargs["decoder_input_ids"] = ids((batch_size, seq_len), vocab)
    return inputs, kwargs


def _forward_params(model: nn.Module) -> list[str]:
    """Named parameters of the bound ``model.forward`` (through decorators' ``__wrapped__``)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters  # follows __wrapped__, drops self
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def build_hf_model(
    model_type: str, *, tiny: bool = False, device: str | torch.device = "meta", seed: int | None = None,
    batch_size: int = 2, seq_len: int = 16, config: Any = None,
) -> tuple[nn.Module, tuple, dict]:
    """``(model, example_inputs, example_kwargs)`` for a transformers model type; see the module doc."""
    from .sources import _hf_build, _hf_config, _transformers

    tf = _transformers()
    cfg = config if config is not None else _hf_config(tf, model_type, None)
    if tiny:
        shrink_config(cfg)
    if _has(cfg, "use_cache"):
        cfg.use_cache = False  # a KV cache object in the outputs cannot be traced
    if seed is not None:
        torch.manual_seed(seed)
    model = _hf_build(tf, cfg, f"hf:{model_type}", device=device)
    if torch.device(device).type != "meta":
        model.float()
    if tiny:
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if isinstance(positions, int):
            seq_len = min(seq_len, positions)
    inputs, kwargs = _example_inputs(model, cfg, device=device, batch_size=batch_size, seq_len=seq_len, seed=seed)
    return model, inputs, kwargs


def positional(model: nn.Module, inputs: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """``inputs`` plus ``kwargs`` placed by ``forward``'s signature (for callers that take
    positional inputs only, such as :func:`shardplan.simulate.simulate`)."""
    if not kwargs:
        return tuple(inputs)
    names = _forward_params(model)
    args = list(inputs)
    for name, value in kwargs.items():
        if name not in names:
            raise ValueError(f"{type(model).__name__}.forward has no parameter {name!r}")
        i = names.index(name)
        args += [None] * max(0, i + 1 - len(args))
        args[i] = value
    return tuple(args)


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

