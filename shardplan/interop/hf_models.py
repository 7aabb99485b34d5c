"""Hugging Face models built from configs, never from downloaded weights.

Contract
--------
``transformers`` is optional and imported only by :func:`transformers_module`, which sets
``HF_HUB_OFFLINE=1`` first, so nothing is ever downloaded.

* ``hf_config(tf, model_type, path)``: the config of a model type (``AutoConfig.for_model``)
  or of a ``config.json``; an unknown type is a ``ValueError`` suggesting close names.
* ``hf_build(tf, cfg, spec, device=...)``: ``AutoModelForCausalLM.from_config``, else
  ``AutoModel.from_config``, under ``torch.device(device)``.
* ``build_hf_model(model_type, *, tiny=False, device="meta", seed=None)`` returns ``(model,
  example_inputs, example_kwargs)`` built from ``AutoConfig.for_model(model_type)``
  (``AutoModelForCausalLM``, else ``AutoModel``) with ``use_cache=False``. ``tiny=True``
  shrinks the config to hidden 64, 2 layers, 4 heads (2 KV heads), intermediate 128, vocab
  512, head_dim 16, 128 positions, 4 experts (2 per token), 32x32 images of 8x8 patches,
  dropout and LayerDrop 0, token ids inside the vocabulary, per-layer lists resized. Inputs: token ids
  ``(batch_size, seq_len)`` (default 2 x 16), ``pixel_values`` for vision models,
  ``decoder_input_ids`` as a keyword for encoder-decoders. Token ids are real CPU tensors
  from a fixed seed (``seed``, else 0) below every vocabulary size, on any device: the tracer
  reads them where forward branches on values. With a ``seed`` (which also seeds torch's
  global RNG before the build) the weights are deterministic too; off the meta device the
  model is float32.
* ``positional(model, inputs, kwargs)``: the inputs placed by ``forward``'s signature;
  ``example_args(model, config, ...)`` the positional example inputs of a built model.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["TINY", "shrink_config", "build_hf_model", "positional", "example_args", "hf_config", "hf_build", "transformers_module",
           "config_dtype", "max_positions", "usable_positions"]


def transformers_module() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"  # never download; must be set before the import
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "Hugging Face models need the optional 'transformers' package; install it with "
            "`pip install shardplan[hf]` (or `pip install transformers`)"
        ) from None
    return transformers


def hf_config(tf: Any, model_type: str | None, path: Path | None) -> Any:
    if path is not None:
        try:
            return tf.AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load Hugging Face config {str(path)!r}: {str(exc).splitlines()[0]}") from None
    known = list(tf.CONFIG_MAPPING.keys())
    if model_type not in known:
        # model types are lower case; transformers' mapping also holds a class name (EvollaModel)
        close = difflib.get_close_matches(model_type or "", [k for k in known if k == k.lower()], n=3)
        hint = f"; did you mean {', '.join('hf:' + c for c in close)}?" if close else "; e.g. hf:llama, hf:gpt2, hf:mistral"
        raise ValueError(f"unknown Hugging Face model type {model_type!r}: expected a transformers model_type{hint}")
    try:
        return tf.AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - a default config its own validators refuse (gemma4_assistant)
        raise ValueError(
            f"hf:{model_type}: transformers cannot make this type's default config ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}); give a path to a config.json of it (or its folder) instead"
        ) from None


def _check_sizes(cfg: Any, spec: str) -> None:
    """A config whose sizes are not positive fails deep inside a constructor; name the key."""
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    for keys, _ in _SIZES:
        for key in keys:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{spec}: config {key} is {value}; sizes (heads, widths, layers) must be positive")


def hf_build(tf: Any, cfg: Any, spec: str, *, device: str | torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of ``cfg`` on ``device``, in ``dtype`` (``None``: transformers' default, fp32)."""
    _check_sizes(cfg, spec)
    with torch.device(device):
        try:
            return _from_config(tf, cfg, spec, dtype=dtype)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the config's values broke the model's constructor
            raise ValueError(
                f"{spec}: transformers could not build {type(cfg).__name__} from this config "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check the config's sizes "
                "(head counts, hidden size, layers must be positive and consistent)"
            ) from None


def config_dtype(cfg: Any) -> torch.dtype:
    """The dtype a config says its weights are in (``dtype``, formerly ``torch_dtype``), else bf16."""
    values = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    value = values.get("dtype") or values.get("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.bfloat16


def _from_config(tf: Any, cfg: Any, spec: str, *, dtype: torch.dtype | None = None) -> nn.Module:
    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        return tf.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError:
        pass
    try:
        return tf.AutoModel.from_config(cfg, **kwargs)
    except ValueError as exc:
        raise ValueError(
            f"{spec}: transformers has no model class for {type(cfg).__name__} "
            f"({str(exc).splitlines()[0][:200]}); pick a text model type such as hf:llama"
        ) from None


TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512,
        "head_dim": 16, "positions": 128, "experts": 4, "experts_per_tok": 2, "image": 32, "patch": 8,
        "rotary_dim": 8}

_SIZES: list[tuple[tuple[str, ...], str]] = [
    (("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim",
      "projection_size"), "hidden"),  # SigLIP: the text head projects onto the vision width
    (("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "n_layers", "num_encoder_layers"), "layers"),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads"), "heads"),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), "kv_heads"),
    (("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
      "moe_intermediate_size", "shared_expert_intermediate_size"), "intermediate"),
    (("vocab_size",), "vocab"),
    (("head_dim", "d_kv", "kv_channels"), "head_dim"),
    (("max_position_embeddings", "n_positions", "n_ctx", "original_max_position_embeddings", "max_target_positions"),
     "positions"),
    (("rotary_dim",), "rotary_dim"),  # the rotary part of a head (gptj, codegen): within the tiny head
    (("num_local_experts", "num_experts", "n_routed_experts"), "experts"),
    (("image_size",), "image"),
    (("patch_size",), "patch"),
]
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
              "cls_token_id", "mask_token_id")


def max_positions(config: Any) -> int | None:
    """The longest sequence the config's position table holds (whisper's decoder names it
    ``max_target_positions``), or None."""
    for name in ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def usable_positions(model: nn.Module, config: Any) -> int | None:
    """:func:`max_positions` less the rows a position table keeps below its first position:
    RoBERTa's family numbers positions from ``padding_idx + 1`` (its position embedding's
    padding row), so a table of 128 holds 126 tokens."""
    positions = max_positions(config)
    if positions is None:
        return None
    offsets = [m.padding_idx + 1 for m in model.modules() if isinstance(m, nn.Embedding)
               and m.num_embeddings == positions and m.padding_idx is not None and m.padding_idx >= 0]
    return positions - max(offsets, default=0)


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


def _shrink_mla(config: Any, sizes: Mapping[str, int]) -> None:
    """Multi-head latent attention (DeepSeek-V3, Kimi K2) sizes its heads by its own keys: the
    rotary part (``qk_rope_head_dim``, which ``head_dim`` must equal for the rotary tables),
    the non-rotary part and the value head, and the two low-rank widths; its keys and values
    are per head (every query head has its own, from the shared latent)."""
    if not _has(config, "qk_rope_head_dim") or not isinstance(getattr(config, "qk_rope_head_dim", None), int):
        return
    head = sizes["head_dim"]
    for name, value in (("qk_rope_head_dim", head // 2), ("head_dim", head // 2), ("qk_nope_head_dim", head),
                        ("v_head_dim", head), ("kv_lora_rank", sizes["hidden"] // 2)):
        _set(config, name, value)
    if isinstance(getattr(config, "q_lora_rank", None), int):
        _set(config, "q_lora_rank", sizes["hidden"] // 2)
    _set(config, "num_key_value_heads", getattr(config, "num_attention_heads", None))  # MLA: one kv per head


def shrink_config(config: Any, sizes: Mapping[str, int] = TINY) -> Any:
    """Shrink ``config`` (and its sub-configs) in place to the tiny sizes; returns it."""
    if getattr(config, "allow_global_per_layer_attribute_access", None) is False:
        # a config whose layers may differ (transformers 5.x ``per_layer_config``) refuses reads
        # of its global sizes; the tiny model sets them alike for every layer
        config.allow_global_per_layer_attribute_access = True
    for names, key in _SIZES:
        for name in names:
            if not _has(config, name):
                continue
            current = getattr(config, name, None)
            if current is None and key in ("kv_heads", "intermediate"):
                continue  # derived from the others when unset
            # an unset head_dim is set: the tiny one equals hidden / heads, what a model that
            # derives it computes, and Ministral's and HunYuan's attention read it as given
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
        elif name == "first_k_dense_replace" and isinstance(value, int) and value > 0:
            _set(config, name, min(value, layers - 1))  # keep a sparse layer after the dense ones
        elif isinstance(value, int) and not isinstance(value, bool):
            _set(config, name, min(value, layers))
    _shrink_mla(config, sizes)
    for name, value in list(config.to_dict().items()):
        # dropout, and LayerDrop (m2m_100 skips whole layers at random in training)
        if any(word in name for word in ("dropout", "pdrop", "layerdrop")) and isinstance(value, float):
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


def example_args(model: nn.Module, config: Any, *, device: Any, batch_size: int, seq_len: int) -> tuple:
    """Positional example inputs for ``model``'s forward: token ids (and an encoder-decoder's
    ``decoder_input_ids``, placed by the signature), or pixels for a vision model."""
    inputs, kwargs = _example_inputs(model, config, device=device, batch_size=batch_size, seq_len=seq_len, seed=None)
    return positional(model, inputs, kwargs)


def _example_inputs(model: nn.Module, config: Any, *, device: Any, batch_size: int, seq_len: int,
                    seed: int | None) -> tuple[tuple, dict]:
    # real values from a fixed seed even for a meta model: the tracer follows branches on
    # them (``if not padding_mask.any():``) and the plan must not depend on the run
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    meta = torch.device(device).type == "meta"
    forward_params = _forward_params(model)

    def ids(shape: tuple[int, ...], high: int) -> torch.Tensor:
        tokens = torch.randint(0, high, shape, generator=gen, device="cpu")
        return tokens if meta else tokens.to(device)

    def pixels() -> torch.Tensor | None:
        # an image model's config, or a text+image model's vision config (CLIP, SigLIP)
        vision = getattr(config, "vision_config", None) or config
        image = getattr(vision, "image_size", None)
        if "pixel_values" not in forward_params or image is None:
            return None
        image = image[0] if isinstance(image, (list, tuple)) else image
        shape = (batch_size, getattr(vision, "num_channels", 3), image, image)
        return torch.zeros(shape, device="meta") if meta else torch.randn(shape, generator=gen).to(device)

    if "input_ids" not in forward_params and (x := pixels()) is not None:
        return (x,), {}
    # ids every token table takes (FSMT's source and target vocabularies differ)
    vocab = min((v for k in _VOCAB_KEYS if isinstance(v := getattr(config, k, None), int) and v > 0), default=2)
    if vocab == 2 and (text := getattr(config, "text_config", None)) is not None:
        vocab = getattr(text, "vocab_size", vocab)
    inputs = (ids((batch_size, seq_len), vocab),)
    kwargs = {}
    if (x := pixels()) is not None:
        kwargs["pixel_values"] = x
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in forward_params:
        kwargs["decoder_input_ids"] = ids((batch_size, seq_len), vocab)
    return inputs, kwargs


_VOCAB_KEYS = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "decoder_vocab_size")


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
    tf = transformers_module()
    cfg = config if config is not None else hf_config(tf, model_type, None)
    if tiny:
        shrink_config(cfg)
    if _has(cfg, "use_cache"):
        cfg.use_cache = False  # a KV cache object in the outputs cannot be traced
    if seed is not None:
        torch.manual_seed(seed)
    model = hf_build(tf, cfg, f"hf:{model_type}", device=device)
    if torch.device(device).type != "meta":
        model.float()
    if tiny:
        positions = usable_positions(model, cfg)
        if isinstance(positions, int):
            seq_len = min(seq_len, positions)
    inputs, kwargs = _example_inputs(model, cfg, device=device, batch_size=batch_size, seq_len=seq_len, seed=seed)
    return model, inputs, kwargs


def positional(model: nn.Module, inputs: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """``inputs`` plus ``kwargs`` placed by ``forward``'s signature (for callers that take
    positional inputs only, such as :func:`shardplan.tools.simulate.simulate`)."""
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
