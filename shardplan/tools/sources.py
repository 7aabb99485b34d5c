"""Sources: turn a model spec from the command line into an ``nn.Module`` to plan.

Contract
--------
``resolve_model(spec, *, device="meta", batch_size=None, seq_len=None)`` returns
``(model, example_inputs, display_name)``; ``example_inputs`` is ``None`` when the caller
should let :func:`shardplan.plan_model` infer them. ``spec`` is one of

* a preset name from :data:`shardplan.models.PRESETS` (``llama3-8b``); example inputs come
  from the preset, sized by ``batch_size``/``seq_len`` when given;
* ``package.module:callable`` (``callable`` may be dotted, ``mod:Class.build``): imported
  and called with no arguments under ``torch.device(device)``; it returns an ``nn.Module``,
  or ``(model, example_inputs)`` (a tensor or a tuple of tensors, used as they are) for a
  model whose inputs cannot be inferred (images, several inputs). The current directory is
  importable, as with ``python -m``;
* ``hf:<model_type>`` (``hf:llama``): a Hugging Face ``transformers`` model built from the
  default config of that type; ``hf-tiny:<model_type>`` the same classes with the config
  shrunk to :data:`shardplan.interop.hf_models.TINY` sizes (for ``simulate`` and ``verify``);
* a path to a Hugging Face ``config.json`` (or a directory holding one).

Hugging Face models are built on ``device`` (meta by default: nothing is allocated) with
``use_cache=False`` so they trace, and fed token ids of shape
``(batch_size or 2, seq_len or min(2048, max_position_embeddings))``. ``transformers`` is
optional and imported only here, lazily, with ``HF_HUB_OFFLINE=1`` set first: nothing is
ever downloaded. Every problem with the spec raises ``ValueError`` saying what was given,
what was expected and what to try.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..analyze.trace import portable_path, user_frame
from ..interop.hf_models import (
    config_dtype, example_args, hf_build, hf_config, shrink_config, transformers_module, usable_positions,
)

__all__ = ["resolve_model", "SPEC_HELP"]

SPEC_HELP = (
    "a preset name (e.g. llama3-8b; see `shardplan plan --help`), 'package.module:callable', "
    "'hf:<model_type>' (e.g. hf:llama; hf-tiny:<model_type> for a small copy) or a path to a Hugging Face config.json"
)
_HF_SEQ_LEN = 2048
TINY_PREFIX = "hf-tiny:"  # hf-tiny:<model_type>: the type's classes at interop.hf_models.TINY sizes


def resolve_model(
    spec: str, *, device: str | torch.device = "meta", batch_size: int | None = None, seq_len: int | None = None
) -> tuple[nn.Module, tuple | None, str]:
    """The model ``spec`` names, its example inputs (or ``None``) and a display name."""
    from ..models import PRESETS

    spec = spec.strip()
    if spec in PRESETS:
        return _preset(spec, device=device, batch_size=batch_size, seq_len=seq_len)
    if spec.startswith("hf:"):
        return _hf_model(spec[3:], spec, device=device, batch_size=batch_size, seq_len=seq_len)
    if spec.startswith(TINY_PREFIX):
        return _hf_model(spec[len(TINY_PREFIX):], spec, device=device, batch_size=batch_size, seq_len=seq_len, tiny=True)
    if _looks_like_path(spec):
        return _hf_model(None, spec, device=device, batch_size=batch_size, seq_len=seq_len, path=_config_path(spec))
    if ":" in spec:
        return (*_from_callable(spec, device=device), spec)
    raise ValueError(_unknown_message(spec, list(PRESETS)))


def _unknown_message(spec: str, presets: list[str]) -> str:
    close = difflib.get_close_matches(spec, presets, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"unknown model {spec!r}: expected {SPEC_HELP}. Presets: {', '.join(presets)}{hint}"


def _preset(
    name: str, *, device: str | torch.device, batch_size: int | None, seq_len: int | None
) -> tuple[nn.Module, tuple, str]:
    from ..models import PRESETS, build_preset

    sizes: dict[str, int] = {}
    if batch_size is not None:
        sizes["batch_size"] = batch_size
    if seq_len is not None:
        sizes["seq_len"] = seq_len
    model = build_preset(name, device=device)
    try:
        inputs = PRESETS[name].example_inputs(device=device, **sizes)
    except ValueError as exc:
        raise ValueError(f"preset {name}: {exc}; pick --batch/--seq within the model's limits") from None
    return model, inputs, name


# --------------------------------------------------------------------------- module:callable


def _from_callable(spec: str, *, device: str | torch.device) -> tuple[nn.Module, tuple | None]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model spec {spec!r} is not 'package.module:callable' (e.g. mypkg.models:build_model)")
    fn = _import_attr(module_name, attr, spec)
    if not callable(fn):
        raise ValueError(f"{spec}: {attr} is a {type(fn).__name__}, not a callable; point at a function or class")
    try:
        with torch.device(device), _no_hard_exit():
            model = fn()
    except (Exception, SystemExit) as exc:  # the user's code: a bad spec, not a crash (nor a silent exit)
        raise ValueError(
            f"{spec}: calling {attr}() raised {type(exc).__name__}: {exc}{_user_site(exc)}; "
            "it must build and return a model with no arguments"
        ) from exc
    inputs = None
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module):
        model, inputs = model  # (model, example_inputs): a model that does not take token ids
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
        if not isinstance(inputs, tuple) or not all(t is None or isinstance(t, torch.Tensor) for t in inputs):
            raise ValueError(f"{spec}: {attr}() returned (model, {type(inputs).__name__}); the second item must be "
                             "the example inputs, a tensor or a tuple of tensors passed to forward() positionally "
                             "(None where an optional argument before a tensor is left out)")
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}: {attr}() returned a {type(model).__name__} object; expected a torch.nn.Module "
                         "or (model, example_inputs)")
    return model, inputs


def _import_attr(module_name: str, attr: str, spec: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{spec}: cannot import module {module_name!r} ({exc}); check the spelling and that it is on PYTHONPATH"
        ) from None
    except SyntaxError as exc:
        raise ValueError(f"{spec}: module {module_name!r} has a syntax error at {portable_path(exc.filename or '?')}:{exc.lineno} "
                         f"({exc.msg}); fix it and retry") from None
    except (Exception, SystemExit) as exc:  # the module's own code raised while it was imported
        raise ValueError(f"{spec}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
                         f"{_user_site(exc)}; fix the module so it imports cleanly") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec}: module {module_name!r} has no attribute {attr!r}; expected 'package.module:callable'")
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def _no_hard_exit() -> Iterator[None]:
    """While the user's builder runs, ``os._exit`` raises ``SystemExit`` instead: a builder
    that ends the process would otherwise make ``shardplan plan`` exit 0 with no plan."""
    real = os._exit

    def refuse(code: int) -> None:
        raise SystemExit(f"os._exit({code})")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _user_site(exc: BaseException) -> str:
    """`` at file:line`` of the innermost frame of the user's code in ``exc``'s traceback."""
    frame = user_frame(exc.__traceback__)
    return f" at {portable_path(frame.filename)}:{frame.lineno}" if frame else ""


# --------------------------------------------------------------------------- Hugging Face


def _looks_like_path(spec: str) -> bool:
    return bool(spec) and (spec.endswith(".json") or os.sep in spec or spec.startswith(".") or Path(spec).is_dir())


def _config_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no Hugging Face config at {str(path)!r}: expected a config.json file or a directory holding one")
    return path


def _hf_model(
    model_type: str | None, spec: str, *, device: str | torch.device, batch_size: int | None,
    seq_len: int | None, path: Path | None = None, tiny: bool = False,
) -> tuple[nn.Module, tuple, str]:
    tf = transformers_module()
    cfg = hf_config(tf, model_type, path)
    if tiny:  # small enough to simulate, verify and run on CPU; the same classes and layer kinds
        shrink_config(cfg)
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False  # a KV cache object in the outputs cannot be traced
    # a spec on the command line is planned in the dtype it trains in: the config's own, else
    # bf16, not transformers' fp32 default (which prices every matmul and byte at twice its size)
    # (hf-tiny: is for running on CPU, where models stay fp32)
    dtype = config_dtype(cfg) if torch.device(device).type == "meta" and not tiny else None
    model = hf_build(tf, cfg, spec, device=device, dtype=dtype)
    max_pos = usable_positions(model, cfg) or _HF_SEQ_LEN
    # batch 2, as presets and plan_model; an encoder-decoder's decoder ids, a ViT's pixels
    inputs = example_args(model, cfg, device=device, batch_size=batch_size or 2, seq_len=seq_len or min(_HF_SEQ_LEN, max_pos))
    return model, inputs, spec


_INPUT_SEED = 1234  # verify's inputs: the same on every rank


def preset_name(spec: str) -> str | None:
    from ..models import PRESETS

    return spec.strip() if spec.strip() in PRESETS else None


def real_inputs(preset: str | None, model: nn.Module, meta_inputs: tuple, *, batch_size: int,
                 seq_len: int | None) -> tuple:
    """CPU inputs, identical on every rank: the preset's fixed batch, the example inputs
    where they are real, else seeded random tensors shaped as the meta inputs (token ids
    below the first Embedding's vocabulary)."""
    if preset is not None:
        from ..models import PRESETS

        sizes = {"batch_size": batch_size} | ({"seq_len": seq_len} if seq_len is not None else {})
        return tuple(PRESETS[preset].example_inputs(device="cpu", **sizes))
    gen = torch.Generator().manual_seed(_INPUT_SEED)
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
    vocab = vocab or getattr(getattr(model, "config", None), "vocab_size", None) or 2
    out = []
    for t in meta_inputs:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            out.append(t)  # real example values (the ones the plan was traced on) are used as given
        elif t.is_floating_point():
            out.append(torch.randn(tuple(t.shape), generator=gen, dtype=t.dtype))
        elif t.dtype == torch.bool:
            out.append(torch.ones(tuple(t.shape), dtype=torch.bool))
        else:
            out.append(torch.randint(0, vocab, tuple(t.shape), generator=gen, dtype=t.dtype))
    return tuple(out)


# small enough to build whole on the CPU to trace it (fp32: 800 MB)
CPU_TRACE_PARAMS = 200_000_000


def plan_traced(spec: str, model: nn.Module, inputs: tuple | None, plan: Callable[[nn.Module, tuple | None], Any], *,
                batch_size: int | None, seq_len: int | None) -> tuple[Any, nn.Module, tuple | None]:
    """``(plan(model, inputs), model, inputs)``; where tracing the meta-built model needs values
    that depend on its weights (a MoE layer that counts its tokens per expert with
    ``bincount(...).tolist()``) and it is small, ``spec`` is built again on the CPU and planned
    with real inputs (:func:`real_inputs`), as the trace's own message advises."""
    from ..analyze.trace import TraceError

    try:
        return plan(model, inputs), model, inputs
    except TraceError as exc:
        if "build the model on CPU" not in str(exc) or sum(p.numel() for p in model.parameters()) > CPU_TRACE_PARAMS:
            raise
    cpu_model, cpu_inputs, _ = resolve_model(spec, device="cpu", batch_size=batch_size, seq_len=seq_len)
    given = cpu_inputs or inputs
    if given is not None:
        cpu_inputs = real_inputs(preset_name(spec), cpu_model, given, batch_size=batch_size or 2, seq_len=seq_len)
    return plan(cpu_model, cpu_inputs), cpu_model, cpu_inputs
