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
  fraction of dense peak, ``memory_time`` for bandwidth-bound work.
* Memory helpers give bytes *per parameter* and *per transformer layer*; the
  caller multiplies by its (sharded) counts.

All estimates are planning figures, meant to rank candidate plans; they do
not model overlap, contention between concurrent collectives, or kernel
launch overheads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .hardware import DTYPE_BYTES, HARDWARE, Hardware, Link, canonical_dtype, dtype_bytes, get_hardware

__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "HARDWARE",
    "Hardware",
    "Link",
    "OPTIMIZERS",
    "ParamStateBytes",
    "activation_bytes_per_layer",
    "axis_links",
    "collective_bytes",
    "collective_time",
    "dtype_bytes",
    "format_bytes",
    "format_seconds",
    "get_hardware",
    "matmul_time",
    "memory_time",
    "param_state_bytes",
    "parse_bytes",
    "training_bytes_per_param",
]

# --------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

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

    all_reduce:                       2(p-1)*alpha + 2(p-1)/p * n * beta
    all_gather/reduce_scatter/a2a:     (p-1)*alpha +  (p-1)/p * n * beta
    with beta = 1 / link.bandwidth; p == 1 costs 0 (no communication).
    """
    _check_collective(kind, num_bytes, group_size)
    steps = _STEP_FACTOR[kind] * (group_size - 1)
    sent = collective_bytes(kind, num_bytes, group_size=group_size)
    return steps * link.alpha_s + sent / link.bandwidth


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


def memory_time(num_bytes: float, *, hardware: Hardware) -> float:
    """Seconds to stream ``num_bytes`` through device memory (reads + writes).

    For bandwidth-bound (elementwise, norm, softmax) ops: bytes / HBM bandwidth.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes!r}")
    return num_bytes / hardware.memory_bandwidth


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
