"""Model code from public libraries: shardplan's plan against each library's own hand-written TP plan.

For each model (``--models``; default all six), from the library's own config builders,
nothing downloaded, one table per size (``--sizes``, default ``96,128,real``): tiny at dim 96
and at dim 128 (2 layers, vocab 256, 8 heads / 4 kv heads), and the library's real configs:

* ``torchtitan`` 0.3.0: ``llama3``, ``qwen3`` (dense) and ``deepseek_v3`` (MLA + MoE). The
  library plan is read off the model itself: torchtitan 0.3.0 declares TP as a
  ``ShardingConfig`` per module config (``models/<name>/sharding.py``, helpers in
  ``models/common/decoder_sharding.py`` and ``moe_sharding.py``), set here exactly as
  ``update_from_config`` does (``enable_sequence_parallel=True``, the default; EP off), and
  ``Module.build`` copies it onto each module as ``_sharding_config``. The TP placement of
  each weight names the style (:func:`titan_style`). Real configs: the registered flavors
  (``model_registry(flavor)``) llama3 8B/70B, qwen3 8B/32B, deepseek_v3 16B (``wq``) and
  671B (``wq_a``/``wq_b``).
* ``torchtune`` 0.6.1: ``llama3``, ``qwen2`` and ``gemma``. Its only TP plan is
  ``torchtune.models.llama3.base_llama_tp_plan`` (``_parallelism.py``); qwen2 and gemma have
  none in 0.6.1, so they are compared with the llama plan applied to their module names
  (the same ``attn.q_proj`` / ``mlp.w1`` layout), marked ``llama-plan``. Real configs: the
  builders ``llama3_8b``, ``llama3_70b``, ``qwen2_7b`` (28 heads, 4 kv), ``gemma_2b`` (one kv
  head) and ``gemma_7b``.

Tiny configs, per model and tp in (2, 4): ``shardplan.plan_model(model, {"tp": tp},
example_inputs=(tokens,), explain=False)`` on the meta device (tokens 2 x 16), median wall
time of ``--runs`` calls (3), a weight-by-weight comparison of ``plan.module_styles()`` with
the library's style (``agree``/``differ``; ``whole``: weights the library leaves whole, i.e.
names no TP placement for or replicates; ``fam``: agreements by family,
colwise/rowwise/replicate/experts, per ``shardplan.interop.hf.STYLE_FAMILY``), ``heads`` (below),
both plans priced by the same cost model, and ``numerics``: ``shardplan.tools.verify.verify``
of shardplan's tp=2 plan on 2 gloo ranks against one process (outputs, loss, every gradient).
Real configs: built on meta, planned at tp=8 only (tokens 2 x 2048, ``explain=False``, one
call), with agreement, ``fam``, ``heads``, shardplan's predicted step and parameters per device
and the plan time; the library's plan is not priced and nothing is verified. A config that
cannot be built on meta is a row saying why. Under each table: every attention not split by
heads and every difference from the library, with the plan's warnings for those modules.

``heads`` = ``k/n``: k of the model's n attention modules are split by heads at that tp.
An attention module is an outermost module whose own name is ``attention``, ``attn``,
``self_attn``, ``self_attention``, ``cross_attn`` or ``cross_attention`` and that holds weight
modules (torchtitan ``layers.N.attention``, torchtune ``layers.N.attn``). Its weight modules
(any depth: torchtitan's fused ``attention.qkv_linear.wqkv``) take roles from the library's
plan wherever that splits something inside the module: colwise family = head projection,
rowwise family = output projection, anything else (MLA's ``wq_a``, ``wkv_a``, norms) no role.
Where the library splits nothing there, names decide: output ``wo``/``o_proj``/``out_proj``/
``output_proj``/``c_proj``/``dense``; head projections ``wq``/``wq_b``/``q_proj``/``wqkv``/
``qkv_proj``/``wk``/``wv``/``k_proj``/``v_proj``/``wkv_b``/``kv_proj``... A head projection whose
name has a ``q`` carries q (``wq``, ``wq_b``, ``q_proj``, the fused ``wqkv``), else it is k/v only
(``wk``, ``v_proj``, MLA's ``wkv_b``). The attention is split by heads when it has a q and an
output projection and, in shardplan's plan:

* every q projection takes ``colwise``, ``packed_colwise``, ``colwise_kv_gathered`` or
  ``colwise_kv_replicated`` (output left split by heads; not ``colwise_gather_output``, not
  ``replicate``);
* every k/v-only projection takes one of those, or ``colwise_gather_output`` where the
  module has fewer kv heads than tp (``n_kv_heads``/``num_kv_heads``/``num_key_value_heads``,
  else ``n_heads``/``num_heads``: MLA's per-head k/v count as n_heads);
* every output projection takes ``rowwise`` (input split by heads; not ``rowwise_split_input``,
  not ``replicate``, not colwise).

An ``nn.MultiheadAttention`` styled ``attention_heads`` is split as well. The totals line
adds up k and n over the rows of a table.

Usage (repository root): ``python benchmarks/ecosystem.py [--models titan-llama3,tune-gemma]
[--sizes 96,128,real] [--runs 3] [--no-verify]`` (``--dim D`` is ``--sizes D``). A library that
is not installed is skipped with the reason. On the 2 shared cores, ``--no-verify --runs 1``
takes ~2-2.5 minutes (each tiny table ~15-35 s, the real configs ~75-100 s, of which
deepseek_v3 16B and 671B ~15-55 s each); verify adds ~1 minute per tiny size.

Import shims (scoped to this script, installed only where the real module is missing):
torchtitan's ``distributed.minimal_async_ep.kernels`` is Triton code imported at module level
by the MoE token dispatcher; the CPU torch has no Triton, so that one module is replaced by
a stub whose kernels raise (EP is never enabled here). A stub ``triton`` package is not used
because torch's own inductor/dynamo modules then import it as if Triton were real.
torchtune's package ``__init__`` imports ``datasets``, ``omegaconf``, ``sentencepiece`` and
``tiktoken`` for its data, config and tokenizer modules, none of which the model code uses:
each is stubbed when absent.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import logging
import os
import re
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

# dim 96 / 8 heads: head_dim 12. No head count equals another dim size (head_dim, head_dim/2
# in RoPE's pairs, batch, seq). At dim 128 head_dim/2 = 8 = heads: the dim-128 table checks
# that shardplan still tells the head count apart (its attention split by heads)
DIM = int(os.environ.get("ECOSYSTEM_DIM", "96"))
LAYERS, VOCAB, HEADS, KV_HEADS, SEQ, BATCH = 2, 256, 8, 4, 16, 2
HEAD_DIM = DIM // HEADS
TPS = (2, 4)
REAL_TP, REAL_TOKENS = 8, (2, 2048)  # real configs: tp=8, batch 2 x seq 2048
TUNE_STUB_MODULES = ("datasets", "datasets.distributed", "omegaconf", "sentencepiece", "tiktoken", "tiktoken.load")
TITAN_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


# --------------------------------------------------------------------------- import shims


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _stub_module(name: str, attr: Callable[[str], object]) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that `import datasets.distributed` resolves to a stub as well
    # a spec, so that later `importlib.util.find_spec(name)` (transformers probing for
    # sentencepiece) answers instead of raising "sentencepiece.__spec__ is None"
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(n: str) -> object:
        if n.startswith("__"):  # inspect and pickle probe dunders: a stub must not claim them
            raise AttributeError(n)
        return attr(n)

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = mod


def _no_kernel(name: str) -> Callable[..., None]:
    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{name}: torchtitan's Triton kernels are stubbed on this CPU-only machine")
    return kernel


def shim_torchtitan() -> None:
    if TITAN_KERNELS not in sys.modules and _missing("triton"):
        _stub_module(TITAN_KERNELS, _no_kernel)


def shim_torchtune() -> None:
    # which packages are missing is decided before any stub exists (a stub has a spec)
    missing = [name for name in TUNE_STUB_MODULES if name not in sys.modules and _missing(name.split(".")[0])]
    for name in missing:
        _stub_module(name, lambda n: type(n, (), {}))  # classes: torchtune subclasses / annotates with them


def library_missing(library: str) -> str | None:
    """Why ``library`` cannot be measured here, or ``None``."""
    if _missing(library):
        return f"{library} is not installed (pip install --no-deps {LIBRARY_PINS[library]})"
    try:
        import_library(library)
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        return f"{library} does not import: {type(exc).__name__}: {exc}"
    return None


LIBRARY_PINS = {"torchtitan": "torchtitan==0.3.0 spmd-types tyro docstring-parser",
                "torchtune": "torchtune==0.6.1 torchao==0.14.1"}


def import_library(library: str) -> None:
    (shim_torchtitan if library == "torchtitan" else shim_torchtune)()
    for spec in SPECS.values():
        if spec.library == library:
            importlib.import_module(f"{library}.models.{spec.model}")


# --------------------------------------------------------------------------- builders (zero-argument: verify calls them)


def _on_meta() -> bool:
    return torch.get_default_device().type == "meta"


def _sdpa(layers: list) -> None:
    # the library default is FlexAttention, which needs torch.compile and a BlockMask; SDPA is
    # the same math with is_causal=True and runs eagerly on CPU and on meta
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _titan_build(config) -> nn.Module:
    model = config.build()
    if not _on_meta():  # RoPE caches are torch.empty until init_states fills them
        model.init_states(buffer_device=torch.get_default_device())
    return model


def build_titan_llama3() -> nn.Module:
    shim_torchtitan()
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = L.Llama3Model.Config(  # llama3 "debugmodel" shrunk; fused wqkv as every llama3 flavor
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="varlen"),
    )
    _sdpa(config.layers)
    set_llama3_sharding_config(config, enable_sp=True)
    return _titan_build(config)


def build_titan_qwen3() -> nn.Module:
    shim_torchtitan()
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    head_dim = HEAD_DIM
    config = Q.Qwen3Model.Config(  # qwen3 "debugmodel" shrunk: tied embeddings, fused wqkv, q/k norms
        vocab_size=VOCAB, dim=DIM, norm=Q._qwen3_norm(DIM), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=Q._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=Q._LINEAR_INIT),
        layers=Q._build_qwen3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim,
            hidden_dim=256, attn_backend="varlen",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0)),
    )
    _sdpa(config.layers)
    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=False)
    return _titan_build(config)


def build_titan_deepseek_v3() -> nn.Module:
    shim_torchtitan()
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    rope_dim = HEAD_DIM
    layers = D._build_dsv3_layers(  # deepseek_v3 "debugmodel" shrunk: layer 0 dense, layer 1 MoE
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=rope_dim, v_head_dim=HEAD_DIM, mscale=0.70,
        dense_hidden_dim=256, moe_hidden_dim=64, num_experts=4, num_shared_experts=2, router_top_k=2,
        router_score_func="softmax", attn_backend="varlen", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=32),
    )
    config = D.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=D._output_linear_init(DIM)),
        layers=layers, mtp_layers=[],
    )
    _sdpa(config.layers)
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=False)
    return _titan_build(config)


def build_tune_llama3() -> nn.Module:
    shim_torchtune()
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=DIM,
                  max_seq_len=64, intermediate_dim=256)


def build_tune_qwen2() -> nn.Module:
    shim_torchtune()
    from torchtune.models.qwen2 import qwen2

    return qwen2(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=DIM,
                 intermediate_dim=256, max_seq_len=64)


def build_tune_gemma() -> nn.Module:
    shim_torchtune()
    from torchtune.models.gemma import gemma

    return gemma(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS,
                 embed_dim=DIM, intermediate_dim=256, max_seq_len=64)


# --------------------------------------------------------------------------- real configs (--sizes real; meta only)


# per model: the library's own registered flavors (torchtitan ``model_registry(flavor)``) or
# model builders (torchtune ``torchtune.models.<model>.<builder>()``), built as published
REAL_CONFIGS: dict[str, tuple[str, ...]] = {
    "titan-llama3": ("8B", "70B"),
    "titan-qwen3": ("8B", "32B"),
    "titan-deepseek_v3": ("16B", "671B"),
    "tune-llama3": ("llama3_8b", "llama3_70b"),
    "tune-qwen2": ("qwen2_7b",),
    "tune-gemma": ("gemma_2b", "gemma_7b"),
}
TITAN_SHARDING = {"llama3": ("set_llama3_sharding_config", {}),
                  "qwen3": ("set_qwen3_sharding_config", {"enable_ep": False}),
                  "deepseek_v3": ("set_deepseek_v3_sharding_config", {"enable_ep": False})}


def build_titan_real(model: str, flavor: str) -> nn.Module:
    """torchtitan's registered ``flavor`` of ``model`` with its ShardingConfig set as
    ``update_from_config`` does (sequence parallel on, EP off); SDPA attention."""
    shim_torchtitan()
    package = importlib.import_module(f"torchtitan.models.{model}")
    config = package.model_registry(flavor, attn_backend="varlen").model
    _sdpa(config.layers)
    setter, kwargs = TITAN_SHARDING[model]
    getattr(importlib.import_module(f"torchtitan.models.{model}.sharding"), setter)(config, enable_sp=True, **kwargs)
    return _titan_build(config)


def build_tune_real(model: str, builder: str) -> nn.Module:
    shim_torchtune()
    return getattr(importlib.import_module(f"torchtune.models.{model}"), builder)()


# --------------------------------------------------------------------------- the libraries' own plans -> shardplan styles


def _tp_type(layout) -> object:
    from torchtitan.distributed.parallel_dims import MeshAxisName

    return None if layout is None else layout.per_axis_spmd_types().get(MeshAxisName.TP)


def titan_style(module: nn.Module) -> str | None:
    """The shardplan style of torchtitan's ``ShardingConfig`` on ``module``; ``None``: no TP placement."""
    import spmd_types as spmd

    config = getattr(module, "_sharding_config", None)
    if config is None:
        return None
    states = config.state_shardings or {}
    weight = _tp_type(states.get("weight"))
    if weight is None and any(isinstance(_tp_type(s), spmd.Shard) for s in states.values()):
        return "moe_tp_experts"  # GroupedExperts: w1_EFD/w3_EFD Shard(1), w2_EDF Shard(2) on the hidden dim
    if isinstance(weight, spmd.Shard) and weight.dim == 0:
        if isinstance(module, nn.Embedding):
            return "embedding_rowwise"  # vocab rows split, Partial output reduced to the (sequence) layout
        gathered = _tp_type(config.out_dst_shardings) is spmd.R
        return "colwise_gather_output" if gathered else "colwise"
    if isinstance(weight, spmd.Shard) and weight.dim == 1:
        return "rowwise"
    split = [_tp_type(l).dim for l in (config.in_src_shardings or {}).values() if isinstance(_tp_type(l), spmd.Shard)]
    if weight is spmd.R and 1 in split:
        return "sequence_parallel"  # a norm on Shard(1) (sequence) activations
    if weight is spmd.R and split:
        return "replicated_with_grad_allreduce"  # qwen3's q/k norms on head-split inputs: Partial weight grads
    return "replicate"


def titan_plan(model: nn.Module) -> dict[str, str]:
    out = {}
    for fqn, module in model.named_modules():
        style = titan_style(module)
        if fqn and style is not None and any(True for _ in module.parameters(recurse=False)):
            out[fqn] = style
    return out


def _tune_style(style, module: nn.Module) -> str | None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    if isinstance(style, PrepareModuleInput):
        return None  # a region boundary, not a weight style
    if isinstance(style, SequenceParallel):
        return "sequence_parallel"
    if isinstance(style, ColwiseParallel):
        return "colwise_gather_output" if isinstance(style.output_layouts[0], Replicate) else "colwise"
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return "embedding_rowwise"
        return "rowwise_split_input" if isinstance(style.input_layouts[0], Replicate) else "rowwise"
    return f"?{type(style).__name__}"


def tune_plan(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    """torchtune's ``base_llama_tp_plan`` expanded over ``model`` (``*`` as in ``parallelize_module``),
    and the plan's keys that match no module."""
    from torchtune.models.llama3 import base_llama_tp_plan

    out, unused = {}, []
    modules = dict(model.named_modules())
    for pattern, style in base_llama_tp_plan().items():
        hits = [fqn for fqn in modules if fqn and fnmatch.fnmatchcase(fqn, pattern) and fqn.count(".") == pattern.count(".")]
        if not hits:
            unused.append(pattern)
        for fqn in hits:
            name = _tune_style(style, modules[fqn])
            if name is not None:
                out[fqn] = name
    return out, unused


# --------------------------------------------------------------------------- measuring


@dataclass
class Spec:
    library: str
    model: str
    builder: str
    note: str = ""


SPECS = {
    "titan-llama3": Spec("torchtitan", "llama3", "build_titan_llama3"),
    "titan-qwen3": Spec("torchtitan", "qwen3", "build_titan_qwen3"),
    "titan-deepseek_v3": Spec("torchtitan", "deepseek_v3", "build_titan_deepseek_v3"),
    "tune-llama3": Spec("torchtune", "llama3", "build_tune_llama3"),
    "tune-qwen2": Spec("torchtune", "qwen2", "build_tune_qwen2", "llama-plan"),
    "tune-gemma": Spec("torchtune", "gemma", "build_tune_gemma", "llama-plan"),
}


@dataclass
class Row:
    spec: Spec
    tp: int
    weights: int = 0
    agree: int = 0
    differ: int = 0
    whole: int = 0
    family: int = 0
    plan_s: float = 0.0
    numerics: str = ""
    diffs: list[tuple[str, str, str]] = field(default_factory=list)  # (module pattern, styles, warning)
    error: str = ""
    # shardplan's plan and the library's (pinned, price_styles): predicted step s, parameter bytes per device
    ours: tuple[float, float] = (0.0, 0.0)
    lib: tuple[float, float] | None = None
    lib_error: str = ""
    lib_note: str = ""  # how the library's plan had to be changed to be priced
    at_lib_memory: float | None = None  # shardplan's step with the library plan's peak memory as budget
    config: str = ""  # "dim 96" for the tiny configs, the flavor / builder name for a real one
    heads: int = 0  # attention modules split by heads (count_heads)
    attentions: int = 0
    unsplit: list[tuple[str, str, str]] = field(default_factory=list)  # (attention pattern, styles, warning)
    priced: bool = True  # the library's plan priced (tiny configs); not at real size

    @property
    def justified(self) -> bool:
        """Priced alike: shardplan's plan is no slower than the library's and holds no more
        parameter bytes per device, or, given the library plan's peak memory as its budget,
        shardplan plans a step no slower than the library's."""
        if self.lib is None:
            return False
        (time_s, params), (lib_time, lib_params) = self.ours, self.lib
        if params <= lib_params * 1.001 and time_s <= lib_time * (1 + 1e-9):
            return True
        return self.at_lib_memory is not None and self.at_lib_memory <= lib_time * (1 + 1e-9)


def _warning_for(plan, fqn: str) -> str:
    rule = plan.rule_for(fqn)
    names = {fqn} | ({rule.module} if rule else set())
    return " | ".join(w for w in plan.warnings if any(w.startswith(f"{n}:") for n in names))


def _generic(fqn: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def compare(row: Row, ours: dict[str, str], theirs: dict[str, str], plan) -> None:
    from shardplan.interop.hf import style_family

    for fqn, style in ours.items():
        lib = theirs.get(fqn, "replicate")
        row.weights += 1
        row.whole += style_family(lib) == "replicate"
        row.family += style_family(lib) == style_family(style)
        if lib == style:
            row.agree += 1
            continue
        row.differ += 1
        row.diffs.append((_generic(fqn), f"library {lib}{'' if fqn in theirs else ' (unnamed)'}, shardplan {style}",
                          _warning_for(plan, fqn)))
    for fqn in sorted(set(theirs) - set(ours)):
        row.diffs.append((_generic(fqn), f"library {theirs[fqn]}, not a weight module of shardplan's plan", ""))


# --------------------------------------------------------------------------- attention split by heads


ATTENTION_NAME = re.compile(r"(self_|cross_)?(attn|attention)")
SPLIT_COLWISE = ("colwise", "packed_colwise", "colwise_kv_gathered", "colwise_kv_replicated")
SPLIT_ROWWISE = ("rowwise",)
OUT_NAMES = ("wo", "Wo", "o_proj", "out_proj", "output_proj", "c_proj", "dense")
HEAD_NAMES = ("wq", "wq_b", "q_proj", "q_b_proj", "wqkv", "Wqkv", "W_pack", "qkv_proj", "qkv", "query_key_value",
              "c_attn", "query", "in_proj", "wk", "wv", "k_proj", "v_proj", "wkv", "wkv_b", "kv_b_proj", "kv_proj",
              "key", "value")
# DeepSeek-V3.2's lightning indexer (and V4's compressor) score keys for the attention with
# heads of their own; where they run is their own choice, not the attention's split
SIDE_MODULES = ("indexer", "compressor")
FUSED_QKV_NAMES = ("c_attn", "in_proj")  # fused q/k/v without a q in the name: they carry q


@dataclass
class Attention:
    fqn: str
    kv_heads: int | None
    q: list[str] = field(default_factory=list)  # head projections carrying q (wq, q_proj, fused wqkv, MLA wq_b)
    kv: list[str] = field(default_factory=list)  # k/v-only head projections (wk, v_proj, MLA wkv_b)
    out: list[str] = field(default_factory=list)  # output projections (wo, output_proj)


def _kv_heads(module: nn.Module) -> int | None:
    for attr in ("n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_heads", "num_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    return None


def _attention_fqns(model: nn.Module, weights: set[str]) -> list[str]:
    """Outermost modules named like an attention (``attention``, ``attn``, ``self_attn``...)
    that hold weight modules."""
    found: list[str] = []
    for fqn, _ in model.named_modules():
        if not fqn or not ATTENTION_NAME.fullmatch(fqn.rsplit(".", 1)[-1]):
            continue
        if any(fqn.startswith(f"{a}.") for a in found):
            continue
        if fqn in weights or any(w.startswith(f"{fqn}.") for w in weights):
            found.append(fqn)
    return found


def _roles(attn: Attention, members: list[str], theirs: dict[str, str]) -> None:
    """Sort an attention's weight modules into q / kv head projections and output projections:
    by the library's plan where it splits something inside (colwise family: head projection,
    rowwise: output), else by name. A name with a ``q`` in it (or a fused ``c_attn``/``in_proj``)
    carries q."""
    from shardplan.interop.hf import style_family

    families = {m: style_family(theirs[m]) for m in members if m in theirs}
    by_library = any(f in ("colwise", "rowwise") for f in families.values())
    for member in members:
        leaf = member.rsplit(".", 1)[-1]
        if any(part in SIDE_MODULES for part in member[len(attn.fqn) + 1:].split(".")[:-1]):
            continue
        family = families.get(member) if by_library else None
        if family == "rowwise" or (not by_library and leaf in OUT_NAMES):
            attn.out.append(member)
        elif family == "colwise" or (not by_library and leaf in HEAD_NAMES):
            (attn.q if "q" in leaf or leaf in FUSED_QKV_NAMES else attn.kv).append(member)


def attention_modules(model: nn.Module, ours: dict[str, str], theirs: dict[str, str]) -> list[Attention]:
    modules = dict(model.named_modules())
    weights = set(ours) | set(theirs)
    found = []
    for fqn in _attention_fqns(model, weights):
        attn = Attention(fqn, _kv_heads(modules[fqn]))
        _roles(attn, sorted(w for w in weights if w.startswith(f"{fqn}.")), theirs)
        found.append(attn)
    return found


def split_by_heads(attn: Attention, ours: dict[str, str], tp: int) -> bool:
    """q projections colwise with the output left split; k/v likewise, or gathered where the
    model has fewer kv heads than tp; output projections rowwise on the split input."""
    if ours.get(attn.fqn) == "attention_heads":  # nn.MultiheadAttention: its packed in_proj by heads
        return True
    kv_ok = SPLIT_COLWISE + (("colwise_gather_output",) if attn.kv_heads is not None and attn.kv_heads < tp else ())
    return (bool(attn.q) and bool(attn.out)
            and all(ours.get(m, "replicate") in SPLIT_COLWISE for m in attn.q)
            and all(ours.get(m, "replicate") in kv_ok for m in attn.kv)
            and all(ours.get(m, "replicate") in SPLIT_ROWWISE for m in attn.out))


def count_heads(row: Row, model: nn.Module, ours: dict[str, str], theirs: dict[str, str], plan) -> None:
    """``row.heads`` of ``row.attentions`` attention modules split by heads; each one that is
    not goes to ``row.unsplit`` with its projections' styles and the plan's warnings."""
    attentions = attention_modules(model, ours, theirs)
    row.attentions = len(attentions)
    for attn in attentions:
        if split_by_heads(attn, ours, row.tp):
            row.heads += 1
            continue
        projections = attn.q + attn.kv + attn.out
        styles = ", ".join(f"{m[len(attn.fqn) + 1:]} {ours.get(m, 'replicate')}" for m in projections) or "no q/k/v/output projection found"
        warning = " | ".join(dict.fromkeys(w for w in (_warning_for(plan, m) for m in projections) if w))
        row.unsplit.append((_generic(attn.fqn), f"kv heads {attn.kv_heads}: {styles}", warning))


def _plan_timed(model: nn.Module, tp: int, tokens: torch.Tensor, runs: int, *, loss_parallel: bool = False):
    import shardplan

    times, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=(tokens,), explain=False, loss_parallel=loss_parallel)
        times.append(time.perf_counter() - t0)
    return plan, statistics.median(times)


def measure(spec: Spec, runs: int) -> tuple[list[Row], list[str]]:
    builder = globals()[spec.builder]
    with torch.device("meta"):
        model = builder()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    theirs, unused = _library_plan(spec, model)
    rows = []
    for tp in TPS:
        row = Row(spec, tp, config=f"dim {DIM}")
        _plan_row(row, model, tokens, theirs, runs)
        _price_library(row, model, tokens, theirs)
        rows.append(row)
    return rows, [f"library plan key {k!r} matches no module" for k in unused]


def _library_plan(spec: Spec, model: nn.Module) -> tuple[dict[str, str], list[str]]:
    return (titan_plan(model), []) if spec.library == "torchtitan" else tune_plan(model)


def _plan_row(row: Row, model: nn.Module, tokens: torch.Tensor, theirs: dict[str, str], runs: int) -> None:
    """shardplan's plan at ``row.tp``: weight-by-weight agreement, attention split by heads,
    its predicted step and parameter bytes; a failure is the row's error."""
    try:
        # torchtitan's recipe trains with the loss-parallel loss unless told not to; both
        # plans are made and priced under the library's own training recipe
        plan, row.plan_s = _plan_timed(model, row.tp, tokens, runs, loss_parallel=_loss_parallel(theirs))
        ours = plan.module_styles()
        compare(row, ours, theirs, plan)
        count_heads(row, model, ours, theirs, plan)
        row.ours = (plan.estimate.step_time_s, plan.estimate.param_bytes_per_device)
    except Exception as exc:  # noqa: BLE001 - a row of the table
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def measure_real(spec: Spec, config: str, runs: int = 1) -> Row:
    """The library's real ``config`` of ``spec``'s model on meta, planned at tp=8 (no
    explanations, no pricing of the library's plan, no verify)."""
    row = Row(spec, REAL_TP, config=config, priced=False)
    try:
        with torch.device("meta"):
            model = build_titan_real(spec.model, config) if spec.library == "torchtitan" else build_tune_real(spec.model, config)
        theirs, _ = _library_plan(spec, model)
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        row.error = f"not built on meta: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    _plan_row(row, model, torch.zeros(REAL_TOKENS, dtype=torch.long, device="meta"), theirs, runs)
    return row


def _price_library(row: Row, model: nn.Module, tokens: torch.Tensor, theirs: dict[str, str]) -> None:
    """The library's own plan priced by shardplan's cost model (its styles pinned; weights it
    does not name replicated). A vocab-sharded head's logits need the loss-parallel loss,
    which the library's recipe turns on with it."""
    import shardplan

    modules = dict(model.named_modules())
    pins = {fqn: style for fqn, style in theirs.items() if fqn in modules}
    for fqn in (n for n, m in modules.items() if m.__class__.__name__ in ("Linear", "Embedding")):
        pins.setdefault(fqn, "replicate")
    # the library's whole modules, in the whole style shardplan can place there: a module
    # whose output feeds split heads whole (MLA's wkv_a and kv_norm) has its gradient summed
    # over the ranks, which a plain replicate does not (torchtitan's DTensors do it implicitly)
    summed = {**pins, **_summed_whole(model, row.tp, tokens, pins, theirs)}
    # last: its sequence-parallel norms replicated, where shardplan has no sequence-parallel
    # plan for the model (an expert bank's output cannot leave on sequence shards)
    no_sp = {fqn: "replicate" if style == "sequence_parallel" else style for fqn, style in summed.items()}
    errors = []
    for attempt, note in ((pins, ""), (summed, ""), (no_sp, "without its sequence parallel")):
        try:
            plan = shardplan.price_styles(model, {"tp": row.tp}, attempt, example_inputs=(tokens,),
                                          loss_parallel=_loss_parallel(theirs))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        row.lib, row.lib_note = (plan.estimate.step_time_s, plan.estimate.param_bytes_per_device), note
        row.lib_error = errors[0] if note and errors else ""
        # shardplan given the library plan's peak memory as its budget: may it trade the
        # memory it saved for speed, as the library did?
        try:
            at_budget = shardplan.plan_model(model, {"tp": row.tp}, example_inputs=(tokens,), explain=False,
                                             memory_budget=int(plan.estimate.peak_memory_bytes),
                                             loss_parallel=_loss_parallel(theirs))
            row.at_lib_memory = at_budget.estimate.step_time_s
        except ValueError:  # the program prices activations per op, above the estimate's per-block figure
            row.at_lib_memory = None
        return
    row.lib_error = errors[0]


def _summed_whole(model: nn.Module, tp: int, tokens: torch.Tensor, pins: dict[str, str], theirs: dict[str, str]) -> dict[str, str]:
    """The library's replicated modules that shardplan can also place whole with their
    gradient all-reduced (``replicated_with_grad_allreduce``), each probed alone."""
    import shardplan

    found = {}
    for fqn, style in pins.items():
        if style != "replicate":
            continue
        try:
            shardplan.price_styles(model, {"tp": tp}, {fqn: "replicated_with_grad_allreduce"},
                                   example_inputs=(tokens,), loss_parallel=_loss_parallel(theirs))
        except ValueError:
            continue
        found[fqn] = "replicated_with_grad_allreduce"
    return found


def _loss_parallel(theirs: dict[str, str]) -> bool:
    """A vocab-sharded head (colwise, logits left split): the library trains it with the
    loss-parallel loss."""
    return any(style == "colwise" and fqn.split(".")[-1] in ("output", "lm_head") for fqn, style in theirs.items())


def numerics(spec: Spec) -> str:
    from shardplan.tools.verify import VerifyError, verify

    try:
        result = verify(f"benchmarks.ecosystem:{spec.builder}", nproc=2, timeout_s=300)
    except VerifyError as exc:
        return f"error: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return result.summary()


# --------------------------------------------------------------------------- output


HEADER = (f"{'library':<10} {'model':<12} {'config':<10} {'tp':>2} {'weights':>7} {'agree':>5} {'differ':>6} {'whole':>5} "
          f"{'fam':>4} {'heads':>5} {'ms':>9} {'lib ms':>7} {'@lib ms':>7} {'MiB':>9} {'lib MiB':>7} {'just':>4} {'plan s':>6}  numerics (tp=2)")


def _fmt(row: Row, verdict: str) -> str:
    model = row.spec.model + ("*" if row.spec.note else "")
    head = f"{row.spec.library:<10} {model:<12} {row.config:<10} {row.tp:>2}"
    if row.error:
        return f"{head} plan failed: {row.error}" if not row.error.startswith("not built") else f"{head} {row.error}"
    lib_ms, lib_mib = (f"{row.lib[0] * 1e3:7.3f}", f"{row.lib[1] / 2**20:7.3f}") if row.lib else ("      -", "      -")
    at_lib = f"{row.at_lib_memory * 1e3:7.3f}" if row.at_lib_memory is not None else "      -"
    just = ("yes" if row.justified else "no") if row.priced else "-"
    heads = f"{row.heads}/{row.attentions}"
    return (f"{head} {row.weights:>7} {row.agree:>5} {row.differ:>6} {row.whole:>5} {row.family:>4} {heads:>5} "
            f"{_num(row.ours[0] * 1e3, 9)} {lib_ms} {at_lib} {_num(row.ours[1] / 2**20, 9)} {lib_mib} {just:>4} "
            f"{row.plan_s:>6.2f}  {verdict}")


def _num(value: float, width: int) -> str:
    """Three decimals, or none where they would not fit the column (real sizes)."""
    text = f"{value:{width}.3f}"
    return text if len(text) <= width else f"{value:{width}.0f}"


def _label(row: Row) -> str:
    """The model, with the real config's name (a tiny table is one dim)."""
    real = "" if row.config.startswith("dim ") else f" {row.config}"
    return f"{row.spec.library} {row.spec.model}{real}"


def _grouped_lines(rows: list[Row], attr: str) -> list[str]:
    """One line per (model, module pattern, styles) of ``row.<attr>`` (``diffs`` or
    ``unsplit``), with the tps it occurs at: layers and tps that differ alike are the same
    finding."""
    seen: dict[tuple[str, str, str, str], list] = {}
    for row in rows:
        for pattern, styles, warning in getattr(row, attr):
            key = (_label(row), pattern, styles, re.sub(r"\.\d+\.", ".*.", warning.replace(f"tp={row.tp}", "tp=N")))
            tps = seen.setdefault(key, [])
            if row.tp not in tps:
                tps.append(row.tp)
    lines = []
    for (model, pattern, styles, warning), tps in seen.items():
        lines.append(f"  {model} tp={','.join(map(str, tps))}: {pattern}: {styles}")
        if warning:
            lines.append(f"      warning: {warning}")
    return lines


def _print_totals(rows: list[Row]) -> None:
    done = [r for r in rows if not r.error]
    weights, agree = sum(r.weights for r in done), sum(r.agree for r in done)
    family = sum(r.family for r in done)
    if weights:
        line = (f"# total: {agree} of {weights} weights take the library's style ({agree / weights:.1%}), "
                f"{family} ({family / weights:.1%}) its style family")
        if any(r.priced for r in done):
            covered = sum(r.weights if r.justified else r.agree for r in done)
            line += f"; with the differences of plans that are justified by the cost model, {covered} ({covered / weights:.1%})"
        print(line)
    heads, attentions = sum(r.heads for r in done), sum(r.attentions for r in done)
    whole = sum(r.attentions > 0 and r.heads == r.attentions for r in done)
    print(f"# attention split by heads: {heads} of {attentions} attention modules; every attention split in "
          f"{whole} of {len(done)} rows" + (f" ({len(rows) - len(done)} rows not planned)" if len(done) < len(rows) else ""))


def _short(verdict: str) -> str:
    if verdict.startswith("PASS"):
        return "PASS"
    if verdict.startswith("FAIL"):
        return "FAIL: " + verdict.split("differs from the unsharded model: ", 1)[-1]
    return verdict[:110]


def _set_dim(dim: int) -> None:
    global DIM, HEAD_DIM
    os.environ["ECOSYSTEM_DIM"] = str(dim)  # verify's ranks re-import this module and build from it
    DIM, HEAD_DIM = dim, dim // HEADS


def _spec_name(spec: Spec) -> str:
    return next(k for k, s in SPECS.items() if s is spec)


def _print_findings(rows: list[Row]) -> None:
    for row in rows:
        if row.lib_note:
            print(f"# {_label(row)} tp={row.tp}: library plan priced {row.lib_note}: as given, {row.lib_error}")
        elif row.lib_error:
            print(f"# {_label(row)} tp={row.tp}: library plan not priced: {row.lib_error}")
    print("\n### attention not split by heads (projections' styles, and the plan's warnings for them)")
    for line in _grouped_lines(rows, "unsplit") or ["  none"]:
        print(line)
    print("\n### differences (library style vs shardplan style; * = every layer index that differs)")
    for line in _grouped_lines(rows, "diffs") or ["  none"]:
        print(line)


def run_tiny(dim: int, names: list[str], runs: int, verify: bool) -> None:
    """The tiny configs at ``dim``, tp=2 and tp=4, the library plans priced, numerics at tp=2."""
    _set_dim(dim)
    print(f"\n## dim {DIM}: tiny configs, {LAYERS} layers, vocab {VOCAB}, {HEADS} heads / {KV_HEADS} kv "
          f"(head_dim {HEAD_DIM}); plan on meta, tokens {BATCH} x {SEQ}; plan s = median of {runs}")
    rows, details, verdicts = [], [], {}
    for name in names:
        try:
            got, notes = measure(SPECS[name], runs)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            details.append(f"{name}: build/trace failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        verdicts[name] = numerics(SPECS[name]) if verify else "skipped"
        rows += got
        details += [f"{name}: {n}" for n in notes]
    print(HEADER)
    for row in rows:
        print(_fmt(row, _short(verdicts[_spec_name(row.spec)]) if row.tp == 2 else ""), flush=True)
    _print_totals(rows)
    _print_findings(rows)
    for line in details:
        print(f"  {line}")
    if verify:
        print(f"\n### numerics (verify, dim {DIM}, tp=2, 2 gloo ranks)")
        for name, verdict in verdicts.items():
            print(f"  {name}: {verdict}")


def run_real(names: list[str]) -> None:
    """Each library's real configs (:data:`REAL_CONFIGS`) on meta at tp=8: plan only, one
    call each (deepseek_v3 takes 15-55 s a call)."""
    print(f"\n## real configs on meta, tp={REAL_TP}, tokens {REAL_TOKENS[0]} x {REAL_TOKENS[1]}; plan only "
          f"(explain=False; the library's plan is not priced, no verify); plan s = one call")
    rows = []
    print(HEADER)
    for name in names:
        for config in REAL_CONFIGS[name]:
            row = measure_real(SPECS[name], config)
            print(_fmt(row, "-"), flush=True)
            rows.append(row)
    _print_totals(rows)
    _print_findings(rows)


def _sizes(text: str, parser: argparse.ArgumentParser) -> list[str]:
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in sizes if s != "real" and not (s.isdigit() and int(s) % HEADS == 0)]
    if bad or not sizes:
        parser.error(f"--sizes: {', '.join(bad) or 'none given'}: each is a dim (a multiple of {HEADS}) or 'real'")
    return sizes


def main() -> int:
    from _machine import speed_note

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SPECS), help=f"comma-separated, of {', '.join(SPECS)}")
    parser.add_argument("--runs", type=int, default=3,
                        help="plan_model calls per (model, tp) of a tiny config; the median is shown (real configs: one call)")
    parser.add_argument("--no-verify", action="store_true", help="skip the 2-rank numerics check")
    parser.add_argument("--sizes", default="96,128,real",
                        help="comma-separated tables: a tiny dim (8 heads, 4 kv heads) or 'real' (the libraries' real configs, tp=8)")
    parser.add_argument("--dim", type=int, default=None, help="one tiny table at this dim (same as --sizes DIM)")
    args = parser.parse_args()
    sizes = _sizes(str(args.dim) if args.dim is not None else args.sizes, parser)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SPECS)}")
    start = time.perf_counter()
    print(f"# ecosystem: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {speed_note()}; sizes {','.join(sizes)}")
    skipped = {lib: library_missing(lib) for lib in {SPECS[n].library for n in names}}
    names = [n for n in names if not skipped[SPECS[n].library]]
    for size in sizes:
        if size == "real":
            run_real(names)
        else:
            run_tiny(int(size), names, args.runs, not args.no_verify)
    print()
    for lib, why in sorted(skipped.items()):
        if why:
            print(f"# skipped {lib}: {why}")
    print("# * no TP plan of its own in torchtune 0.6.1: compared with torchtune's llama3 plan on its module names")
    print("# whole: weights the library leaves whole (no TP placement, or replicated/sequence-parallel); "
          "fam: agreements by style family; heads: attention modules split by heads / attention modules")
    print("# ms, MiB: shardplan's plan, predicted step and parameters per device; lib ms, lib MiB: the library's "
          "plan pinned (price_styles), same cost model; @lib ms: shardplan's plan with the library plan's peak memory "
          "as its budget; just: shardplan's plan is no slower with no more parameter bytes, or no slower at the "
          "library's memory")
    print(f"# elapsed {time.perf_counter() - start:.1f} s; machine at end: {speed_note()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
