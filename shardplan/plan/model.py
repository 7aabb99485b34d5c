"""Plan: the data a planning run produces, and its YAML file.

Contract
--------
A :class:`Plan` is plain data (pydantic, ``extra="forbid"``): the mesh, the model's
fingerprint, the options the planner used, one :class:`Rule` per weight-owning module
(repeated blocks written once as a ``*`` pattern), the :class:`Region` entries where one
``PrepareModuleInput`` lets several Linears share a collective, the estimates, and for each
decision the cost of the alternatives it beat. ``to_yaml``/``from_yaml`` round-trip
losslessly with stable key order; loading uses ``yaml.safe_load`` only, so a plan file
never runs code. Applying a plan is :mod:`shardplan.apply.emit`'s job.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .fileio import PlanFileError, atomic_write, describe, load_mapping, read_text
from .patterns import brace_members, brace_ranges, expand_braces, expand_pattern, matches  # noqa: F401 - re-exported

__all__ = [
    "int_attributes", "set_int_attribute", "persistent_buffer",
    "STYLES", "Rule", "Region", "LocalAttributes", "LocalBuffers", "ViewFix", "CutFix", "LengthFix", "SliceFix", "LocalViews", "Estimate", "Alternative", "Decision", "ModelInfo", "MeshInfo",
    "PlanOptions", "Plan", "load_plan", "load_plan_with_lines", "expand_braces", "brace_ranges", "brace_members", "fingerprint", "PlanFileError", "LAYOUT_RE", "portable", "SIGNIFICANT_DIGITS",
]

STYLES = (
    "colwise", "rowwise", "colwise_gather_output", "colwise_kv_replicated", "colwise_kv_gathered", "packed_colwise", "rowwise_split_input", "embedding_rowwise",
    "sequence_parallel", "replicated_with_grad_allreduce", "norm_sharded", "moe_tp_experts", "moe_whole_experts", "ep_experts", "attention_heads",
    "dtensor_weights", "listed_heads", "replicate",
)
Style = Literal[
    "colwise", "rowwise", "colwise_gather_output", "colwise_kv_replicated", "colwise_kv_gathered", "packed_colwise", "rowwise_split_input", "embedding_rowwise",
    "sequence_parallel", "replicated_with_grad_allreduce", "norm_sharded", "moe_tp_experts", "moe_whole_experts", "ep_experts", "attention_heads",
    "dtensor_weights", "listed_heads", "replicate",
]
LAYOUT_RE = re.compile(r"^(Replicate|Partial|Shard\((-?\d+)\))$")
MAX_TENSOR_DIMS = 8  # Shard(d) needs -8 <= d < 8: no activation or weight has more dims


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_layout(value: str) -> str:
    m = LAYOUT_RE.match(value)
    if not m:
        raise ValueError(f"layout {value!r} is not one of Replicate, Partial, Shard(d)")
    if m.group(2) is not None and not -MAX_TENSOR_DIMS <= int(m.group(2)) < MAX_TENSOR_DIMS:
        raise ValueError(f"layout {value!r} shards a dimension no tensor here has; use Shard(d) with "
                         f"{-MAX_TENSOR_DIMS} <= d < {MAX_TENSOR_DIMS} (Shard(1) is the sequence, Shard(-1) the features)")
    return value


AxisSize = Annotated[int, Field(strict=True, ge=1, le=2**31 - 1)]  # strict: `tp: true` is not tp=1
Count = Annotated[int, Field(strict=True, ge=1)]


Layout = Annotated[str, AfterValidator(_check_layout)]


def _check_module_pattern(value: str) -> str:
    bad = next((part for part in value.split(".") if "{" in part or "}" in part), None) if value else None
    if bad is not None and brace_members(bad) is None:
        raise ValueError(f"segment {bad!r} is not an index set; write layer indices as {{0-2,5}}")
    return value


ModulePattern = Annotated[str, AfterValidator(_check_module_pattern)]


def _check_packed(value: object) -> object:
    """``packed``: a count of equal parts (int >= 2) or the relative widths of unequal ones."""
    if value is None:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
        return value
    if (isinstance(value, list) and len(value) >= 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return value
    raise ValueError(f"packed {value!r} is neither a count of equal parts (an int >= 2) nor the widths of unequal ones "
                     "(a list of two or more ints >= 1, relative or in rows: [4, 1, 1] for q, k, v of 8, 2 and 2 heads)")


Packed = Annotated[Annotated[int, Field(ge=2)] | Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2)] | None,
                   BeforeValidator(_check_packed)]


class Rule(_Strict):
    module: ModulePattern  # fnmatch pattern per path segment, as parallelize_module matches; {0-2,5} index sets
    style: Style
    input_layouts: Layout | None = None
    output_layouts: Layout | None = None
    # the output is modified in place downstream (``x += y``): hand on a copy, since the
    # local view of a DTensor cannot be modified in place
    copy_output: bool = False
    # rowwise with output_layouts Partial: False keeps the partial sums a Partial DTensor (a
    # block that sums its branches and residual as DTensors, then all-reduces once); the
    # default hands each rank's summand on as a plain tensor, as torch's RowwiseParallel does
    use_local_output: bool | None = None
    # packed_colwise: how many equal parts the output dim holds, or the relative widths of
    # unequal ones ([4, 1, 1]: a GQA [Q; K; V] of 8 q and 2 kv heads; rows [64, 16, 16] too)
    packed: Packed = None
    # packed_colwise: the last this many parts (k, v) are gathered whole after the matmul on
    # the ranks whose query heads read them (one kv head fused after the query heads: rank r
    # holds [q_r, k, v]); their rows are still split tp ways at rest, as the other parts' are
    whole_parts: Annotated[int, Field(strict=True, ge=1)] | None = None
    # ep_experts: the bank's experts E, split whole over the mesh's ep axis (E / ep per rank),
    # and with a tp axis too, how each rank's experts sit on it: split inside as
    # moe_tp_experts splits them, or whole on every tp rank (replicate, the default)
    num_experts: Annotated[int, Field(strict=True, ge=1)] | None = None
    inner: Literal["moe_tp_experts", "replicate"] | None = None
    # colwise_kv_replicated: the weight's rows form this many groups (one per kv head), each
    # held whole by tp / groups ranks; colwise_kv_gathered: each group gathered across them;
    # packed_colwise with whole_parts: the whole parts hold this many kv heads, each gathered
    # over its tp / groups ranks (absent: one kv head, gathered over all of tp)
    groups: Annotated[int, Field(strict=True, ge=2)] | None = None
    # MLA's shared rotary key, broadcast to heads split tp ways, hands back partial gradients:
    # colwise_gather_output sums its output's (a reduce-scatter backward, not a slice), and a
    # colwise on such a value leaves its input's Partial gradient for that producer to sum
    output_grad_partial: bool = False
    input_grad_partial: bool = False
    # a container's own parameters (``replicate`` rule) placed other than Replicate, by
    # name: gpt-oss's per-head ``sinks: Shard(0)`` beside attention split by heads
    param_layouts: dict[str, Layout] = Field(default_factory=dict)
    # replicate: other code reads this module's parameters as plain tensors (torchtune's
    # TiedLinear, a plain object, computes with the embedding's weight): the model's whole
    # forward sees their local tensors, and the module runs on plain inputs
    read_outside: bool = False
    # a container's own parameters kept whole whose gradients come out Partial (a learned
    # temperature scaling scores split by heads): all-reduced once when backward ends
    partial_grads: list[str] = Field(default_factory=list)
    why: str = ""

    @model_validator(mode="after")
    def _whole_parts_of_packed(self) -> "Rule":
        n = len(self.packed) if isinstance(self.packed, list) else 0
        if self.groups is not None and self.style == "packed_colwise" and self.whole_parts is None:
            raise ValueError(f"groups {self.groups} with packed_colwise and no whole_parts: groups says over how many "
                             "ranks the whole parts are gathered; give whole_parts too, or drop groups")
        if self.whole_parts is not None and (self.style != "packed_colwise" or not 0 < self.whole_parts < n):
            raise ValueError(f"whole_parts {self.whole_parts} with style {self.style} and packed {self.packed}: "
                             "whole_parts is for packed_colwise with a list of part widths, fewer than the parts "
                             "(packed: [8, 1, 1], whole_parts: 2 for 8 query heads, then one k and one v head)")
        return self


class Region(_Strict):
    """Where a value enters DTensor once for all the Linears that read it: the module's
    input (PrepareModuleInput) or, for ``input: output``, the module's output
    (PrepareModuleOutput)."""

    module: ModulePattern
    input: int | str  # positional index, keyword name, or "output"
    num_inputs: int  # positional arguments of the traced call
    input_layouts: Layout = "Replicate"
    desired_input_layouts: Layout = "Replicate"
    use_local_output: bool = False  # hand plain tensors on (a block's exit) or DTensors (an entry)
    # Replicate -> Shard(d) taken in runs of ``fold`` along d: heads folded into the batch
    # (Bloom's ALiBi, ``[b * heads, 1, keys]``, fold = heads) give each rank its heads of every
    # run, the layout ``_StridedShard(d, split_factor=b)`` holds, whatever the batch
    fold: Annotated[int, Field(strict=True, ge=2)] | None = None
    # input: output, Partial -> Shard(1) of tokens the module flattened: the output's rows are
    # this argument's ``[b, s]`` (Llama 4's MoE returns ``[b * s, h]``); viewed so, reduce-scattered
    # along the sequence, flattened back: each rank's sequence shard of every row, whatever ``b``
    tokens_of: Annotated[int, Field(strict=True, ge=0)] | str | None = None
    # input: output of a module returning a tuple: the element converted, of how many
    output_index: Annotated[int, Field(strict=True, ge=0)] | None = None
    num_outputs: Annotated[int, Field(strict=True, ge=1)] | None = None
    why: str = ""

    @model_validator(mode="after")
    def _one_output_of_a_tuple(self) -> "Region":
        if (self.output_index is None) != (self.num_outputs is None) or (
                self.output_index is not None and (self.input != "output" or self.output_index >= self.num_outputs)):
            raise ValueError(f"output_index {self.output_index} of num_outputs {self.num_outputs} (input {self.input!r}): "
                             "give both, with input: output and 0 <= output_index < num_outputs, or neither")
        return self

    @property
    def is_slice(self) -> bool:
        """A whole input cut where the module receives it (Replicate -> Shard(d)): no collective."""
        return self.input != "output" and self.input_layouts == "Replicate" and self.desired_input_layouts.startswith("Shard")

    @model_validator(mode="after")
    def _fold_cuts_a_whole_input(self) -> "Region":
        if self.fold is not None and not self.is_slice:
            raise ValueError(f"fold {self.fold} with input {self.input!r}, {self.input_layouts} -> "
                             f"{self.desired_input_layouts}: a fold cuts a module's whole input (Replicate -> Shard(d)); "
                             "drop fold or give those layouts")
        return self

    @model_validator(mode="after")
    def _tokens_of_a_partial_output(self) -> "Region":
        if self.tokens_of is not None and (self.input != "output" or self.input_layouts != "Partial"
                                           or self.desired_input_layouts != "Shard(1)"):
            raise ValueError(f"tokens_of {self.tokens_of!r} with input {self.input!r}, {self.input_layouts} -> "
                             f"{self.desired_input_layouts}: tokens_of reduce-scatters a module's flattened tokens "
                             "(input: output, Partial -> Shard(1)); drop tokens_of or give those layouts")
        return self

    @model_validator(mode="after")
    def _input_is_an_argument(self) -> "Region":
        if isinstance(self.input, int) and not 0 <= self.input < self.num_inputs:
            raise ValueError(f"input {self.input} is not one of the call's {self.num_inputs} positional arguments "
                             f"(0..{self.num_inputs - 1}); use an index in range, a keyword name, or 'output'")
        return self


class LocalAttributes(_Strict):
    """Integer attributes a module's code sizes tensors by (``view(b, s, self.num_heads,
    d)``), set to their value on one rank's shards when the plan is applied. The planner
    writes one only when the module's shards fail to run with the global value and run
    with these (the local check proves it)."""

    module: ModulePattern
    values: dict[str, Annotated[int, Field(strict=True, ge=1)]]
    why: str = ""


class LocalBuffers(_Strict):
    """Tensors a module's forward writes activations into (a KV cache: ``self.cache_k[:b,
    p:p + s] = xk``), each split as the values written into it are: when the plan is
    applied, each rank's module holds its chunk on that dim (``Shard(2)``: its kv heads) as a
    plain tensor, which its code writes and reads as it did the whole one. A persistent
    buffer's state-dict entry stays global: the rank's chunk is saved and loaded as a
    ``Shard`` DTensor.
    ``groups``: a tensor's ``Shard(d)`` dim holds that many kv heads, fewer than tp; it is
    cut into that many chunks and rank r holds chunk ``r // (tp / groups)``, the kv head its
    query heads read (as ``colwise_kv_replicated`` holds the rows of the k/v projection)."""

    module: ModulePattern
    layouts: dict[str, Layout]
    groups: dict[str, Annotated[int, Field(strict=True, ge=2)]] = Field(default_factory=dict)  # omitted when empty
    why: str = ""

    @model_validator(mode="after")
    def _groups_name_layouts(self) -> "LocalBuffers":
        extra = sorted(set(self.groups) - set(self.layouts))
        if extra:
            raise ValueError(f"groups names {extra}, which layouts does not split; give each a Shard layout or drop it from groups")
        return self


class Collectives(_Strict):
    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0
    all_to_all: int = 0


SIGNIFICANT_DIGITS = 6


def portable(value: float, *, seconds: bool) -> float:
    """A predicted figure made independent of the machine's float rounding.

    Estimates are sums of many products, and the last bit of such a sum can depend on the
    order a BLAS kernel adds in, which differs between CPUs. Times keep ``SIGNIFICANT_DIGITS``
    significant digits and byte counts whole bytes, both far coarser than that noise, so a
    plan (in memory, and the file it writes) is the same on every machine."""
    if value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if seconds else float(round(value))


class _Estimated(_Strict):
    """A record of predicted figures: ``*_s`` fields are seconds, the other floats bytes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _portable(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():
            seconds = key.endswith("_s")
            if isinstance(value, float):
                out[key] = portable(value, seconds=seconds)
            elif key == "collective_bytes" and isinstance(value, dict):
                out[key] = {k: portable(v, seconds=False) if isinstance(v, float) else v for k, v in value.items()}
        return out


class ViewFix(_Strict):
    """One view of a module's code that spells a global width: its dim ``dim`` is divided by
    ``parts`` (tp, or a kv-group count) on one rank's shard.

    With ``seq_dim`` it is the ``call``-th view the module's own source file makes while its
    forward runs (every view and reshape with explicit sizes counted, ``-1`` or not; a
    library helper's views are not, as they may differ by device), sized by a length read off a
    sequence shard (``B, T, C = x.shape`` of an input under sequence parallel, then
    ``q.view(B, T, H, C // H)`` of the gathered q): dim ``seq_dim`` is multiplied by
    ``seq_parts`` as well. Such a view holds as many elements as its tensor, so it does not
    fail; it regroups the rows, which is why it is named by its call."""

    dim: Annotated[int, Field(strict=True, ge=0)]
    parts: Annotated[int, Field(strict=True, ge=1)]
    call: Annotated[int | None, Field(strict=True, ge=0)] = None
    seq_dim: Annotated[int | None, Field(strict=True, ge=0)] = None
    seq_parts: Annotated[int | None, Field(strict=True, ge=2)] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "ViewFix":
        sequence = (self.call, self.seq_dim, self.seq_parts)
        if any(v is None for v in sequence) and any(v is not None for v in sequence):
            raise ValueError(f"call, seq_dim and seq_parts go together; got {sequence}")
        if self.seq_dim is None and self.parts < 2:
            raise ValueError(f"parts must be at least 2 for a view fix without seq_dim; got {self.parts}")
        if self.seq_dim is not None and self.seq_dim == self.dim and self.parts > 1:
            raise ValueError(f"seq_dim {self.seq_dim} is also the dim divided by {self.parts}")
        return self


class CutFix(_Strict):
    """One cut of a module's code by a global width (``qkv(x).split(C, dim=-1)``,
    ``qkv[..., :C]``, ``qkv.narrow(-1, C, C)`` with ``C`` read off the whole input): on one
    rank's shard, the ``call``-th cut the module's forward makes gets its numbers (the split
    sizes, the slice's bounds, narrow's start and length) divided by ``parts``."""

    call: Annotated[int, Field(strict=True, ge=0)]
    parts: Annotated[int, Field(strict=True, ge=1)]
    # the cut's numbers are a length read off a sequence shard (``self.bias[:, :, :T, :T]``,
    # ``freqs[:T]``): multiplied by ``seq_parts`` instead, every bounded slice of it
    seq_parts: Annotated[int | None, Field(strict=True, ge=2)] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "CutFix":
        if (self.seq_parts is None) == (self.parts < 2):
            raise ValueError(f"a cut fix divides by parts >= 2 or multiplies by seq_parts (parts 1); "
                             f"got parts={self.parts}, seq_parts={self.seq_parts}")
        return self


class LengthFix(_Strict):
    """A tensor the module's own code makes from a length it read off a sequence shard
    (``torch.ones(T, T).tril()``, ``torch.arange(T)``): the ``call``-th call of ``function``
    (a factory: ``ones``, ``zeros``, ``empty``, ``full``, ``arange``...) gets its integer
    arguments at ``args`` (positions among its sizes, in order) multiplied by ``parts``, the
    whole length the gathered tensors hold."""

    function: Annotated[str, Field(min_length=1)]
    call: Annotated[int, Field(strict=True, ge=0)]
    args: Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)]
    parts: Annotated[int, Field(strict=True, ge=2)]


class SliceFix(_Strict):
    """A whole value the module's own code makes (ALiBi slopes from ``self.n_heads``, or a
    buffer of them, times the positions) read by an op beside values split tp ways: on one
    rank, the ``call``-th call of ``function`` (Python's name, underscores stripped: ``add``
    for ``+``) the module's forward makes gets its ``input``-th tensor argument cut to this
    rank's part of dim ``dim`` (``parts`` equal parts, rank order), a local slice."""

    function: Annotated[str, Field(min_length=1)]
    call: Annotated[int, Field(strict=True, ge=0)]
    input: Annotated[int, Field(strict=True, ge=0)]
    dim: Annotated[int, Field(strict=True, ge=0)]
    parts: Annotated[int, Field(strict=True, ge=2)]


class LocalViews(_Strict):
    """Views sized by a width the code reads off a whole tensor (``B, T, C = x.size()`` of
    the attention's input, then ``y.view(B, T, C)`` of its heads' output: nanoGPT, minGPT,
    timm's ViT, fairseq). No attribute holds ``C``, so the planner records the views
    instead: while the module runs, the ``k``-th view or reshape whose sizes hold more
    elements than its tensor (by exactly ``parts``, no ``-1``) gets ``fixes[k]``. A view that
    already fits is left as written; so does a cut (``split``, ``narrow``, a slice) not named
    in ``cuts`` (the same width cut apart: ``q, k, v = qkv(x).split(C, dim=-1)``). The planner writes one only when
    the module's shards fail to run as written and run with these, every view giving its
    planned local shape."""

    module: ModulePattern
    fixes: list[ViewFix] = Field(default_factory=list)
    cuts: list[CutFix] = Field(default_factory=list)
    slices: list[SliceFix] = Field(default_factory=list)
    lengths: list[LengthFix] = Field(default_factory=list)
    why: str = ""


class Estimate(_Estimated):
    param_bytes_per_device: float
    peak_memory_bytes: float
    comm_bytes_per_step: float
    step_time_s: float
    compute_time_s: float = 0.0
    comm_time_s: float = 0.0
    collectives: dict[str, Collectives] = Field(default_factory=dict)
    # logical bytes (whole tensors) the collectives of each phase are about
    collective_bytes: dict[str, float] = Field(default_factory=dict)


class Alternative(_Estimated):
    style: str
    step_time_s: float | None = None  # None: infeasible
    param_bytes_per_device: float | None = None
    reason: str = ""


class Decision(_Estimated):
    module: str
    style: str
    step_time_s: float
    param_bytes_per_device: float
    alternatives: list[Alternative] = Field(default_factory=list)


class ModelInfo(_Strict):
    class_name: str
    fingerprint: str
    num_params: Annotated[int, Field(strict=True, ge=0)]
    repeats: dict[str, Count | list[str]] = Field(default_factory=dict)  # container -> its children's count or names


class MeshInfo(_Strict):
    axes: dict[str, AxisSize]
    tp_axis: str
    # expert parallel: expert banks split by whole experts over this axis, a data axis for the rest
    ep_axis: str | None = None

    @model_validator(mode="after")
    def _tp_axis_is_an_axis(self) -> "MeshInfo":
        if self.tp_axis not in self.axes:
            raise ValueError(f"tp_axis {self.tp_axis!r} is not one of the mesh axes {list(self.axes)}")
        if self.ep_axis is not None and (self.ep_axis not in self.axes or self.ep_axis == self.tp_axis):
            raise ValueError(f"ep_axis {self.ep_axis!r} must be one of the mesh axes {list(self.axes)} other than "
                             f"tp_axis {self.tp_axis!r}")
        return self


class PlanOptions(_Strict):
    batch_size: Annotated[int, Field(ge=1)] | None = None
    seq_len: Annotated[int, Field(ge=1)] | None = None
    dtype: str | None = None  # training dtype; None: the model's parameter dtype
    hardware: str = "h100-nvlink"
    memory_budget: Annotated[int, Field(ge=1)] | None = None
    sequence_parallel: bool | None = None  # None: let the optimizer decide
    loss_parallel: bool = False
    optimizer: Literal["adamw", "adamw-mixed", "adam", "sgd-momentum", "sgd", "none"] = "adamw"  # memory model
    # the other mesh axes: "fsdp" shards parameters, gradients and optimizer state over them
    # (torchtitan's default), "ddp" replicates them
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"


class Plan(_Strict):
    version: Literal[1] = 1
    model: ModelInfo
    mesh: MeshInfo
    options: PlanOptions = Field(default_factory=PlanOptions)
    rules: list[Rule]
    regions: list[Region] = Field(default_factory=list)
    attributes: list[LocalAttributes] = Field(default_factory=list)  # omitted from files when empty
    buffers: list[LocalBuffers] = Field(default_factory=list)  # omitted from files when empty
    local_views: list[LocalViews] = Field(default_factory=list)  # omitted from files when empty
    estimate: Estimate | None = None
    decisions: list[Decision] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _experts_on_an_ep_axis(self) -> "Plan":
        for rule in self.rules:
            if rule.style != "ep_experts":
                continue
            if self.mesh.ep_axis is None or rule.num_experts is None:
                raise ValueError(f"rule {rule.module} (ep_experts) needs mesh.ep_axis and the rule's num_experts; "
                                 f"got ep_axis {self.mesh.ep_axis!r}, num_experts {rule.num_experts!r}")
            if rule.num_experts % self.ep:
                raise ValueError(f"rule {rule.module} (ep_experts): num_experts {rule.num_experts} does not divide over "
                                 f"{self.mesh.ep_axis}={self.ep}; use an ep that divides {rule.num_experts}")
        return self

    @property
    def tp(self) -> int:
        return self.mesh.axes[self.mesh.tp_axis]

    @property
    def ep(self) -> int:
        return self.mesh.axes[self.mesh.ep_axis] if self.mesh.ep_axis else 1

    def module_styles(self) -> dict[str, str]:
        """Every weight-owning module FQN -> its style name, patterns expanded."""
        out: dict[str, str] = {}
        for rule in self.rules:
            for fqn in expand_pattern(rule.module, self.model.repeats):
                out[fqn] = rule.style
        return dict(sorted(out.items(), key=lambda kv: _natural_key(kv[0])))

    def rule_for(self, fqn: str) -> Rule | None:
        return next((r for r in self.rules if matches(r.module, fqn)), None)

    def explain(self, fqn: str) -> Decision:
        rule = self.rule_for(fqn)
        if rule is None:
            raise ValueError(f"no rule in this plan covers {fqn!r}; weight modules look like {self.rules[0].module!r}")
        for d in self.decisions:
            if d.module == rule.module:
                return d
        raise ValueError(f"the plan records no decision for {rule.module!r} (it was written without explanations)")

    def to_data(self) -> dict:
        """The plan as plain data, as its files store it: a rule or region states its
        required keys and then only the options it sets."""
        data = self.model_dump(mode="json", exclude_none=False)
        for key, kind in (("rules", Rule), ("regions", Region)):
            data[key] = [_set_keys(item, kind) for item in data[key]]
        for key in ("attributes", "buffers", "local_views"):
            if not data[key]:
                del data[key]
        if data["mesh"]["ep_axis"] is None:  # files without expert parallelism do not mention it
            del data["mesh"]["ep_axis"]
        for entry in data.get("buffers", []):
            if not entry["groups"]:
                del entry["groups"]
        for entry in data.get("local_views", []):
            for key in ("fixes", "cuts", "slices", "lengths"):
                if not entry[key]:
                    del entry[key]
            for fix in entry.get("cuts", []):
                if fix["seq_parts"] is None:
                    del fix["seq_parts"]
            for fix in entry.get("fixes", []):  # a fix by a length read off a sequence shard names its call
                if fix["seq_dim"] is None:
                    del fix["call"], fix["seq_dim"], fix["seq_parts"]
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_data(), sort_keys=False, default_flow_style=False, width=120)

    def to_json(self) -> str:
        return json.dumps(self.to_data(), indent=2)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "<string>") -> "Plan":
        return cls.from_yaml_with_lines(text, source=source)[0]

    @classmethod
    def from_yaml_with_lines(cls, text: str, *, source: str = "<string>") -> tuple["Plan", dict[tuple, int]]:
        """The plan and the line of every key (``("rules", 3, "style")`` -> 12), from one parse."""
        data, lines = load_mapping(text, source=source)
        try:
            return cls.model_validate(data), lines
        except ValidationError as exc:
            raise PlanFileError(describe(exc, lines, source)) from None

    def save(self, path: str | Path, *, force: bool = True) -> None:
        atomic_write(Path(path), self.to_yaml(), force=force)

    def to_hf_tp_plan(self, model=None) -> dict[str, str]:
        """Hugging Face ``tp_plan`` mapping (patterns use ``*`` for layer indices), for
        ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan=...))``.

        Only what Hugging Face's registered styles reproduce exactly is exported: colwise,
        rowwise, colwise_gather_output, rowwise_split_input, embedding_rowwise, replicate,
        replicated_with_grad_allreduce, packed_colwise (two parts) and moe_tp_experts, each
        with the layouts transformers gives that name. Anything else raises ``ValueError``
        saying which module and what to do instead: kv heads in groups, ``attention_heads``,
        MLA's partial-gradient latent, a loss-parallel head, sequence parallelism, other
        layouts, per-rank attribute values or views, a container's own split parameters, and
        layers that take different styles under one name. ``model`` (the module the plan was
        made for; the meta device will do) lets the export check module types: Hugging Face's
        styles split ``nn.Linear`` layouts only (GPT-2's ``Conv1D`` [in, out] is refused),
        its packed_colwise cannot split a fused bias, and an expert bank's own parameters
        need keys of their own; plans with packed_colwise or moe_tp_experts need it."""
        from .hf_export import to_hf_tp_plan  # the module types it checks need torch: imported when asked

        return to_hf_tp_plan(self, model)

    def to_hf_ep_plan(self, model) -> tuple[dict[str, str], dict[str, int]]:
        """Hugging Face ``ep_plan`` and ``DistributedConfig`` keyword arguments (``ep_size``,
        ``fsdp_size``) of an expert-parallel plan without tensor parallelism:
        ``DistributedConfig(ep_plan=plan, **kwargs)``; see :func:`.hf_export.to_hf_ep_plan`."""
        from .hf_export import to_hf_ep_plan

        return to_hf_ep_plan(self, model)


def _set_keys(item: dict, kind: type[BaseModel]) -> dict:
    """Required keys always (a root rule's ``module`` is ``''``); optional ones only when set
    (``false`` is set where the default is null: a rule's ``use_local_output``)."""
    fields = kind.model_fields
    return {k: v for k, v in item.items() if fields[k].is_required() or not (
        v is None or (v is False and fields[k].default is not None) or v in ("", {}, []))}


def load_plan(path: str | Path) -> Plan:
    return load_plan_with_lines(path)[0]


def load_plan_with_lines(path: str | Path) -> tuple[Plan, dict[tuple, int]]:
    p = Path(path)
    return Plan.from_yaml_with_lines(read_text(p), source=str(p))


def _natural_key(fqn: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in fqn.split(".")]


def fingerprint(model) -> str:
    """sha256 over the class name and every parameter's name, shape and dtype."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, shape, dtype in _parameter_specs(model):
        h.update(f"{name}:{tuple(shape)}:{str(dtype).replace('torch.', '')};".encode())
    return "sha256:" + h.hexdigest()[:32]


def _parameter_specs(model):
    """``named_parameters(remove_duplicate=False)``'s names, shapes and dtypes, where a module
    another rank holds (an expert split over ep: ``held_params``) stands for its own."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        held = getattr(module, "held_params", None)
        if held is not None:
            yield from ((dot + name, shape, dtype) for name, shape, dtype in held)
            continue
        for name, p in module._parameters.items():
            if p is not None:
                yield dot + name, p.shape, p.dtype


def int_attributes(module) -> dict[str, int]:
    """The integer attributes a module's code may size tensors by: its own (``self.num_heads``),
    those of the config object it keeps (``self.config.num_attention_heads``, as phi3's
    attention reads), spelled ``config.<name>``, and its submodules' own, spelled
    ``<child path>.<name>``: Meta's Llama reference code calls ``self.attention.forward(...)``
    from the block, so the block is where its views are checked and run."""
    found = _own_ints(module)
    config = vars(module).get("config")
    if config is not None and not hasattr(config, "_parameters") and hasattr(config, "__dict__"):
        found.update((f"config.{k}", v) for k, v in vars(config).items() if type(v) is int and not k.startswith("_"))
    for path, sub in module.named_modules():
        # not a leaf that owns weights: a Linear's in_features sizes its own weight, not the code
        if path and not (sub._parameters and not sub._modules):
            found.update((f"{path}.{k}", v) for k, v in _own_ints(sub).items())
    return found


def persistent_buffer(module, name: str) -> bool:
    """``name`` is a buffer of ``module`` that its state dict saves (registered persistent)."""
    return name in module._buffers and name not in module._non_persistent_buffers_set


def _own_ints(module) -> dict[str, int]:
    return {k: v for k, v in vars(module).items() if type(v) is int and not k.startswith("_")}


def set_int_attribute(module, name: str, value: int) -> None:
    """Set one of :func:`int_attributes`. A ``config.`` value goes into a copy of the config
    that this module alone keeps: the config object is shared by every layer and the model,
    whose other readers (the rotary embedding, ``save_pretrained``) keep the global value."""
    import copy

    owner, _, attr = name.rpartition(".")
    if owner == "config":
        if not getattr(module, "_shardplan_own_config", False):
            module.config = copy.copy(module.config)
            module._shardplan_own_config = True
        setattr(module.config, attr, value)
    else:
        setattr(module.get_submodule(owner) if owner else module, attr, value)
