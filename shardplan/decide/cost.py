"""Cost-model primitives for sharding-plan search.

Contract
--------
Everything here is a pure function of plain Python numbers (no torch import,
no I/O, no global state beyond the read-only tables ``DTYPE_BYTES`` and
``HARDWARE``). Units are SI throughout: bytes, seconds, FLOPs, bytes/s.

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
from dataclasses import dataclass, field

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
# dtypes
# --------------------------------------------------------------------------

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
}

# Long names fold onto the short ones used as keys of Hardware.peak_flops.
_CANONICAL_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _canonical_dtype(name: str) -> str:
    """``"torch.bfloat16"`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"``."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        valid = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r}; expected one of: {valid}")
    return _CANONICAL_DTYPE.get(key, key)


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name`` (``str(torch.float32)`` also works)."""
    return DTYPE_BYTES[_canonical_dtype(name)]


# --------------------------------------------------------------------------
# hardware profiles
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One interconnect in the alpha-beta model.

    ``alpha_s`` is the latency of one algorithm step; ``bandwidth`` is bytes/s
    per direction per device, so the per-byte cost beta is ``1 / bandwidth``.
    """

    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"Link.alpha_s must be finite and >= 0, got {self.alpha_s!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link.bandwidth must be finite and > 0, got {self.bandwidth!r}")


@dataclass(frozen=True)
class Hardware:
    """Per-device figures of one cluster type.

    Bandwidths are bytes/s per direction per device; ``peak_flops`` maps a
    canonical dtype (``fp32``, ``bf16``, ``fp16``, ``fp8``) to dense peak
    FLOP/s, without structured sparsity.
    """

    name: str
    description: str
    devices_per_node: int
    intra_alpha_s: float
    intra_bandwidth: float
    inter_alpha_s: float
    inter_bandwidth: float
    # Excluded from the hash (dicts are unhashable) so profiles can key caches.
    peak_flops: dict[str, float] = field(hash=False)
    matmul_efficiency: float
    memory_bytes: int
    memory_bandwidth: float

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"{self.name}: devices_per_node must be >= 1")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"{self.name}: matmul_efficiency must be in (0, 1]")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"{self.name}: memory figures must be > 0")
        for dtype, flops in self.peak_flops.items():
            if _canonical_dtype(dtype) != dtype or flops <= 0:
                raise ValueError(f"{self.name}: bad peak_flops entry {dtype!r}: {flops!r}")
        Link(alpha_s=self.intra_alpha_s, bandwidth=self.intra_bandwidth)  # validates
        Link(alpha_s=self.inter_alpha_s, bandwidth=self.inter_bandwidth)

    @property
    def intra_link(self) -> Link:
        """Link between devices of one node."""
        return Link(alpha_s=self.intra_alpha_s, bandwidth=self.intra_bandwidth)

    @property
    def inter_link(self) -> Link:
        """Link between nodes, per device."""
        return Link(alpha_s=self.inter_alpha_s, bandwidth=self.inter_bandwidth)


# Shared figures and their sources.
#
# Latency per ring step (alpha): NCCL's tuning model (NVIDIA/nccl,
# src/graph/tuning.cc, table hwLat, Ring/Simple protocol) charges 3.4 us per
# step over NVLink, 5.7 us over PCIe and 9.6-14 us over the network (value
# depends on NCCL version), plus a one-off base latency of 8.4 us. Spreading
# that base over the 2(p-1) = 14 steps of an 8-GPU all_reduce adds ~0.6 us:
# NVLink ~4 us, PCIe ~6 us, network ~15 us per step.
_NVLINK_ALPHA_S = 4e-6
_PCIE_ALPHA_S = 6e-6
_NET_ALPHA_S = 15e-6

# Dense-GEMM efficiency: large cuBLAS GEMMs reach roughly 60-80% of dense
# peak; 0.6 is the conservative end. It scales every matmul equally, so it
# moves absolute step times but not the ranking of plans on one profile.
_GPU_MATMUL_EFFICIENCY = 0.6

# NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): BF16/FP16
# Tensor 1,979 TFLOPS and FP8 3,958 TFLOPS *with sparsity* -> halved for dense;
# FP32 (non-tensor) 67 TFLOPS; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s
# total = 450 GB/s per direction. nccl-tests typically reach ~80-90% of that
# as bus bandwidth, so communication estimates are on the optimistic side.
_H100_NODE = dict(
    devices_per_node=8,
    intra_alpha_s=_NVLINK_ALPHA_S,
    intra_bandwidth=450e9,
    peak_flops={"fp32": 67e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
    memory_bytes=80 * 10**9,
    memory_bandwidth=3.35e12,
)
# DGX H100: one ConnectX-7 NIC per GPU at 400 Gb/s (NDR) = 50 GB/s per
# direction per device.
_IB_NDR = dict(inter_alpha_s=_NET_ALPHA_S, inter_bandwidth=50e9)


def _profiles() -> dict[str, Hardware]:
    """Build the built-in profiles (one place, so sources sit beside figures)."""
    profiles = [
        Hardware(
            name="h100-nvlink",
            description="8x H100 SXM5 in one NVLink 4 node; inter-node figures "
            "are the 400 Gb/s IB ones of h100-ib, used only if an axis spans nodes",
            **_H100_NODE,
            **_IB_NDR,
        ),
        Hardware(
            name="h100-ib",
            description="H100 SXM5 cluster: NVLink 4 inside 8-GPU nodes, "
            "one 400 Gb/s ConnectX-7 (NDR InfiniBand) per GPU between nodes",
            **_H100_NODE,
            **_IB_NDR,
        ),
        _a100(),
        _l40s_pcie(),
        _cpu_gloo(),
    ]
    return {hw.name: hw for hw in profiles}


def _a100() -> Hardware:
    # NVIDIA A100 80GB SXM datasheet: BF16/FP16 Tensor 312 TFLOPS dense (624
    # sparse), FP32 19.5 TFLOPS, no FP8; HBM2e 2,039 GB/s; NVLink 3 600 GB/s
    # total = 300 GB/s per direction. DGX A100: one ConnectX-6 HDR 200 Gb/s
    # NIC per GPU = 25 GB/s per direction.
    return Hardware(
        name="a100",
        description="A100 80GB SXM4 cluster: NVLink 3 inside 8-GPU nodes, "
        "one 200 Gb/s HDR InfiniBand NIC per GPU between nodes",
        devices_per_node=8,
        intra_alpha_s=_NVLINK_ALPHA_S,
        intra_bandwidth=300e9,
        inter_alpha_s=_NET_ALPHA_S,
        inter_bandwidth=25e9,
        peak_flops={"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
        matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
        memory_bytes=80 * 10**9,
        memory_bandwidth=2.039e12,
    )


def _l40s_pcie() -> Hardware:
    # NVIDIA L40S datasheet: BF16/FP16 Tensor 362.05 TFLOPS dense (733 sparse),
    # FP8 733 dense (1,466 sparse), FP32 91.6 TFLOPS; 48 GB GDDR6 at 864 GB/s;
    # no NVLink, PCIe Gen4 x16 = 64 GB/s bidirectional, 32 GB/s per direction
    # raw, ~25 GB/s after 128b/130b encoding and TLP overhead. Between nodes:
    # a 200 Gb/s NIC per GPU (25 GB/s), typical of PCIe inference servers.
    return Hardware(
        name="pcie",
        description="8x L40S on PCIe Gen4 x16 per node (no NVLink), "
        "200 Gb/s network per GPU between nodes",
        devices_per_node=8,
        intra_alpha_s=_PCIE_ALPHA_S,
        intra_bandwidth=25e9,
        inter_alpha_s=_NET_ALPHA_S,
        inter_bandwidth=25e9,
        peak_flops={"fp32": 91.6e12, "bf16": 362e12, "fp16": 362e12, "fp8": 733e12},
        matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
        memory_bytes=48 * 10**9,
        memory_bandwidth=864e9,
    )


def _cpu_gloo() -> Hardware:
    # Measured on the development machine (2-core AMD EPYC VM with AVX-512,
    # 24 GB RAM, torch 2.13.0+cpu) by `python benchmarks/calibrate_gloo.py`
    # on 2026-11-29; median of three runs (ranges: alpha 116-126 us,
    # bandwidth 1.97-2.38 GB/s, fp32 105-115 GFLOP/s, bf16 490-507 GFLOP/s).
    # Two gloo ranks over localhost TCP; alpha/beta fitted on all_reduce from
    # 4 KB to 64 MB (the fit is within ~1.2x from 4 KB to 64 MB; large gloo
    # all_gathers run 2-4x slower than this model). FLOP/s are best 1024^3
    # matmuls on one thread, as each rank gets one core (two threads measure
    # ~2x); they are achieved large-matmul rates, hence matmul_efficiency 1.0.
    # Memory: RAM split over the two ranks; bandwidth from a 256 MB
    # single-thread copy (read + write). There is no second node: inter-node
    # figures repeat the loopback ones.
    alpha_s, bandwidth = 1.24e-4, 2.0e9
    return Hardware(
        name="cpu-gloo",
        description="2 gloo ranks on one 2-core CPU host (localhost TCP); "
        "figures measured by benchmarks/calibrate_gloo.py",
        devices_per_node=2,
        intra_alpha_s=alpha_s,
        intra_bandwidth=bandwidth,
        inter_alpha_s=alpha_s,
        inter_bandwidth=bandwidth,
        peak_flops={"fp32": 1.13e11, "bf16": 5.02e11},
        matmul_efficiency=1.0,
        memory_bytes=12_638_255_104,
        memory_bandwidth=3.8e10,
    )


HARDWARE: dict[str, Hardware] = _profiles()


def get_hardware(name: str) -> Hardware:
    """The built-in profile called ``name``."""
    try:
        return HARDWARE[name]
    except KeyError:
        valid = ", ".join(sorted(HARDWARE))
        raise ValueError(f"unknown hardware profile {name!r}; expected one of: {valid}") from None


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
    key = _canonical_dtype(dtype)
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
