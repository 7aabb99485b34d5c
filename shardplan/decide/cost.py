"""Cost-model primitives for sharding-plan search.

Contract
--------
Everything here is a pure function of plain Python numbers (no torch import,
no I/O, no global state beyond the read-only tables ``DTYPE_BYTES`` and
``HARDWARE`` of :mod:`.hardware`, re-exported here). Units are SI throughout: bytes,
seconds, FLOPs, bytes/s.

* Collective times follow the alpha-beta model of ring algorithms
  (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005; the same step counts NCCL's own tuning
  model uses in ``src/graph/tuning.cc``). ``num_bytes`` is always the *full,
  logical* tensor size (for all_gather: the gathered result; for
  reduce_scatter: the input before scattering), and a group of one costs 0.
* ``axis_links`` maps each device-mesh axis to the link its collectives run
  over. Axes are ordered outermost first, as in ``torch DeviceMesh``: the last
  axis holds contiguous ranks, which share a node.
* Compute is roofline-style: ``matmul_time`` for FLOP-bound work at a fixed
  fraction of dense peak, ``memory_time`` for bandwidth-bound work,
  ``elementwise_time`` for a bandwidth-bound op's forward *and* backward, and
  ``optimizer_time`` for the optimizer's update of a device's parameters
  (the bytes torch's foreach implementation streams per parameter).
* A collective also pays ``Link.call_s`` once per call: the host's dispatch
  (DTensor redistribute, functional collective, wait), which dominates small
  collectives on a CPU; the per-module counterpart is
  ``Hardware.module_overhead_s``, charged by the solver's ``strategy_time``.
* Memory helpers give bytes *per parameter* and *per transformer layer*; the
  caller multiplies by its (sharded) counts.

All estimates are planning figures, meant to rank candidate plans; they do
not model overlap or contention between concurrent collectives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .hardware import COLLECTIVES, DTYPE_BYTES, HARDWARE, Hardware, Link, canonical_dtype, dtype_bytes, get_hardware

__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "HARDWARE",
    "Hardware",
    "Link",
    "OPTIMIZERS",
    "ParamStateBytes",
    "activation_bytes_per_layer",
    "attention_flops",
    "axis_links",
    "collective_bytes",
    "collective_time",
    "dtype_bytes",
    "elementwise_time",
    "format_bytes",
    "format_seconds",
    "get_hardware",
    "matmul_time",
    "memory_time",
    "optimizer_step_bytes",
    "optimizer_time",
    "param_state_bytes",
    "parse_bytes",
    "training_bytes_per_param",
]

# --------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------

# Ring step counts as multiples of (p - 1). all_reduce = reduce_scatter
# followed by all_gather, hence twice the steps and twice the traffic.
# all_to_all is modelled as p-1 pairwise exchanges of n/p bytes each.
_STEP_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def _check_collective(kind: str, num_bytes: float, group_size: int) -> None:
    if kind not in _STEP_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; expected one of: {', '.join(COLLECTIVES)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not (num_bytes >= 0 and math.isfinite(num_bytes)):
        raise ValueError(f"num_bytes must be finite and >= 0, got {num_bytes!r}")


def collective_bytes(kind: str, num_bytes: float, *, group_size: int) -> float:
    """Bytes each device sends (and receives) in ring ``kind`` over ``group_size``.

    With n = ``num_bytes`` (full logical size) and p = ``group_size``:
    all_reduce sends 2(p-1)/p * n; all_gather, reduce_scatter and all_to_all
    send (p-1)/p * n (each of the p-1 steps moves one n/p chunk).
    """
    _check_collective(kind, num_bytes, group_size)
    p = group_size
    return _STEP_FACTOR[kind] * (p - 1) / p * num_bytes


def collective_time(kind: str, num_bytes: float, *, group_size: int, link: Link) -> float:
    """Seconds for ring collective ``kind`` of ``num_bytes`` over ``link``.

    all_reduce:                       call + 2(p-1)*alpha + 2(p-1)/p * n * beta
    all_gather/reduce_scatter/a2a:    call +  (p-1)*alpha +  (p-1)/p * n * beta
    with beta = 1 / link.bandwidth and call = link.call_s (the host's fixed cost
    of issuing one collective); the ring terms are scaled by
    ``link.kind_factor[kind]`` (1 unless the backend runs that kind otherwise).
    p == 1 costs 0 (no communication is issued).
    """
    _check_collective(kind, num_bytes, group_size)
    if group_size == 1:
        return 0.0
    steps = _STEP_FACTOR[kind] * (group_size - 1)
    sent = collective_bytes(kind, num_bytes, group_size=group_size)
    ring = steps * link.alpha_s + sent / link.bandwidth
    return link.call_s + link.kind_factor.get(kind, 1.0) * ring


def axis_links(hardware: Hardware, axis_sizes: Mapping[str, int]) -> dict[str, Link]:
    """The link each mesh axis communicates over, in ``axis_sizes`` order.

    Axes are outermost first; the last axis is innermost (contiguous ranks).
    The devices that share an axis-``i`` group lie within a span of
    ``size_i * prod(sizes after i)`` consecutive ranks, so the axis stays on
    one node iff that product is <= ``devices_per_node``. Otherwise its ring
    crosses nodes, and the slowest hop (the NIC) bounds it: the whole
    collective is charged at inter-node figures (pessimistic on alpha, since
    only some hops leave the node).
    """
    links: dict[str, Link] = {}
    span = 1
    for axis, size in reversed(list(axis_sizes.items())):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {axis!r} must have an int size >= 1, got {size!r}")
        span *= size
        intra = span <= hardware.devices_per_node
        links[axis] = hardware.intra_link if intra else hardware.inter_link
    return {axis: links[axis] for axis in axis_sizes}


# --------------------------------------------------------------------------
# compute
# --------------------------------------------------------------------------


def matmul_time(flops: float, *, hardware: Hardware, dtype: str) -> float:
    """Seconds for ``flops`` of matmul work: flops / (peak[dtype] * efficiency)."""
    key = canonical_dtype(dtype)
    if key not in hardware.peak_flops:
        valid = ", ".join(sorted(hardware.peak_flops))
        raise ValueError(f"{hardware.name} has no peak FLOP/s for {dtype!r}; it has: {valid}")
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    return flops / (hardware.peak_flops[key] * hardware.matmul_efficiency)


def attention_flops(
    *, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, value_dim: int | None = None
) -> float:
    """Forward + backward FLOPs of scaled dot-product attention over all ``heads``.

    The forward is two batched matmuls, scores = q k^T (2*b*h*sq*sk*d) and out = p v
    (2*b*h*sq*sk*dv); the backward is twice that, as for any matmul (one product per
    operand). Counted dense, whatever the mask (torch's FlopCounterMode counts the same):
    a kernel that skips masked blocks runs faster than this. Softmax is left to memory.
    """
    _check_positive_ints(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
    dv = head_dim if value_dim is None else value_dim
    return 3 * 2 * batch * heads * seq_q * seq_k * (head_dim + dv)


def memory_time(num_bytes: float, *, hardware: Hardware) -> float:
    """Seconds to stream ``num_bytes`` through device memory (reads + writes).

    For bandwidth-bound (elementwise, norm, softmax) ops: bytes / HBM bandwidth.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes!r}")
    return num_bytes / hardware.memory_bandwidth


# An elementwise op's backward reads the output gradient and the saved inputs and writes
# one gradient per input: about twice the forward's traffic, as a matmul's backward is
# twice its forward's FLOPs (dx and dW).
_BACKWARD_TRAFFIC = 2.0


def elementwise_time(forward_bytes: float, *, hardware: Hardware) -> float:
    """Seconds for a bandwidth-bound op's forward and backward, given the forward's bytes
    (inputs read + output written): ``(1 + 2) * forward_bytes / memory_bandwidth``."""
    return (1 + _BACKWARD_TRAFFIC) * memory_time(forward_bytes, hardware=hardware)


# --------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamStateBytes:
    """Training-state bytes held per parameter, by component."""

    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


# Optimizer state bytes per parameter, by whether params are fp32 or low
# precision. Mixed precision (Micikevicius et al. 2018) keeps an fp32 master
# copy (4 B) beside fp32 optimizer moments; ZeRO (Rajbhandari et al. 2020,
# sec. 3.1) counts mixed-precision Adam as 2 + 2 + 12 = 16 B per parameter.
#                (fp32 params, 16-/8-bit params)
_OPTIMIZER_STATE = {
    "adamw": (8.0, 12.0),  # m + v (4 + 4) [+ fp32 master 4]
    "sgd-momentum": (4.0, 8.0),  # momentum 4 [+ master 4]
    "sgd": (0.0, 4.0),  # nothing [+ master 4]
}
_OPTIMIZER_ALIASES = {"adamw-mixed": "adamw", "adam": "adamw"}
OPTIMIZERS = (*_OPTIMIZER_STATE, "none")


def param_state_bytes(*, dtype: str, optimizer: str = "adamw") -> ParamStateBytes:
    """Bytes per parameter for params in ``dtype`` trained with ``optimizer``.

    Params and grads are held in ``dtype``; optimizer state is fp32, plus an
    fp32 master copy when ``dtype`` is narrower than fp32. ``"none"`` means
    inference: parameters only. Under tensor parallelism all three components
    shard like the parameter itself.
    """
    width = dtype_bytes(dtype)
    name = _OPTIMIZER_ALIASES.get(optimizer, optimizer)
    if name == "none":
        return ParamStateBytes(param=width, grad=0.0, optimizer=0.0)
    if name not in _OPTIMIZER_STATE:
        valid = ", ".join([*OPTIMIZERS, *_OPTIMIZER_ALIASES])
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of: {valid}")
    full, mixed = _OPTIMIZER_STATE[name]
    return ParamStateBytes(param=width, grad=width, optimizer=full if width >= 4 else mixed)


def training_bytes_per_param(*, dtype: str, optimizer: str = "adamw") -> float:
    """Total bytes per parameter: 16 for AdamW in bf16 (2+2+12) and fp32 (4+4+8)."""
    return param_state_bytes(dtype=dtype, optimizer=optimizer).total


# Bytes the optimizer's update streams per parameter, counted op by op from torch's
# foreach implementations (torch/optim/adam.py ``_multi_tensor_adam`` with decoupled
# weight decay, sgd.py ``_multi_tensor_sgd``; foreach is torch's default on GPUs and what a
# DTensor model needs), each op reading its tensor operands and writing its result, in
# 4-byte words (fp32 state; mixed precision updates the fp32 master copy):
#   adamw: mul_(p) 2, lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 4, sqrt(v) 2,
#          div_ 2, add_(eps) 2, addcdiv_(p, m, denom) 4                  = 21 words
#   sgd-momentum: mul_(buf) 2, add_(buf, g) 3, add_(p, buf) 3           =  8 words
#   sgd: add_(p, g) 3                                                   =  3 words
_OPTIMIZER_WORDS = {"adamw": 21, "sgd-momentum": 8, "sgd": 3, "none": 0}


def optimizer_step_bytes(*, optimizer: str = "adamw") -> float:
    """Bytes read + written per parameter by one step of ``optimizer`` (see above):
    84 for AdamW, 32 for SGD with momentum, 12 for SGD, 0 for ``"none"`` (inference)."""
    name = _OPTIMIZER_ALIASES.get(optimizer, optimizer)
    if name not in _OPTIMIZER_WORDS:
        valid = ", ".join([*OPTIMIZERS, *_OPTIMIZER_ALIASES])
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of: {valid}")
    return 4.0 * _OPTIMIZER_WORDS[name]


def optimizer_time(num_params: float, *, hardware: Hardware, optimizer: str = "adamw") -> float:
    """Seconds for one optimizer step over ``num_params`` parameters held on a device:
    a bandwidth-bound pass of ``optimizer_step_bytes`` per parameter."""
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params!r}")
    return memory_time(num_params * optimizer_step_bytes(optimizer=optimizer), hardware=hardware)


def _check_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def activation_bytes_per_layer(
    *,
    seq_len: int,
    batch_size: int,
    hidden: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: float = 2,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per device.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", sec. 4 (no recomputation), with s = seq_len,
    b = batch_size, h = hidden, a = num_heads, t = tp:

        no TP:    s*b*h * (34 + 5*a*s/h)
        TP:       s*b*h * (10 + 24/t + 5*a*s/(h*t))   # LayerNorm/dropout inputs replicated
        TP + SP:  s*b*h/t * (34 + 5*a*s/h)            # everything sharded

    The paper assumes 2-byte activations (and 1-byte dropout masks); the
    result is scaled by ``dtype_bytes / 2``, masks included, as an estimate.
    """
    _check_positive_ints(seq_len=seq_len, batch_size=batch_size, hidden=hidden,
                         num_heads=num_heads, tp=tp)
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes!r}")
    s, b, h, a, t = seq_len, batch_size, hidden, num_heads, tp
    attention = 5 * a * s / h  # the s x s score/softmax/dropout tensors
    if sequence_parallel:
        per_token = (34 + attention) / t
    else:
        per_token = 10 + 24 / t + attention / t
    return s * b * h * per_token * dtype_bytes / 2


# --------------------------------------------------------------------------
# parsing and formatting
# --------------------------------------------------------------------------

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """Parse a size: ``"80GB"`` (10**9), ``"80GiB"`` (2**30), ``"1.5TB"``, ``"4096"``.

    Units are case-insensitive; a ``b`` always means bytes. The result is
    rounded to whole bytes; a unitless fraction (``"1.5"``) is rejected.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"byte size must be >= 0, got {text!r}")
        return text
    match = _BYTES_RE.fullmatch(text) if isinstance(text, str) else None
    unit = match and _BYTE_UNITS.get(match.group(3).lower())
    if not match or unit is None:
        raise ValueError(
            f"cannot parse byte size {text!r}; expected e.g. '80GB', '80GiB' or '4096'"
        )
    try:
        value = float(match.group(1)) * 10 ** int(match.group(2) or 0) * unit
        whole = int(round(value))
    except (OverflowError, ValueError):  # 1e400: no device has that many bytes
        raise ValueError(f"byte size {text!r} is out of range; give a device's memory, e.g. '80GB'") from None
    if unit == 1 and value != whole:
        raise ValueError(f"byte size {text!r} is not a whole number of bytes; e.g. '1.5GB'")
    return whole


def format_bytes(num_bytes: float) -> str:
    """Binary units with two decimals: ``1.23 GiB``, ``512 B``."""
    sign, n = ("-" if num_bytes < 0 else ""), abs(num_bytes)
    if round(n) < 1024:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if round(n, 2) < 1024:  # so 1023.999 KiB reads "1.00 MiB", not "1024.00 KiB"
            return f"{sign}{n:.2f} {unit}"
    return f"{sign}{n / 1024:.2f} PiB"


def format_seconds(seconds: float) -> str:
    """Three significant digits in s/ms/us/ns: ``1.2 ms``, ``340 us``, ``2.5 s``."""
    sign, raw = ("-" if seconds < 0 else ""), abs(seconds)
    if raw >= 999.5:  # whole seconds beyond three digits
        return f"{sign}{raw:.0f} s"
    s = float(f"{raw:.3g}")  # round first, so 0.99999 picks "s", not "ms"
    if s == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{sign}{s / scale:.3g} {unit}"
    return f"{sign}{s / 1e-9:.3g} ns"
