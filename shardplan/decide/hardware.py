"""Hardware: the dtypes and the per-device figures of each cluster type the cost model prices.

Contract
--------
``DTYPE_BYTES``/``dtype_bytes`` give bytes per element; ``HARDWARE`` maps a profile name
(``h100-nvlink``, ``h100-ib``, ``a100``, ``pcie``, ``cpu-gloo``) to a frozen
:class:`Hardware`: links inside and between nodes (alpha-beta :class:`Link`), dense peak
FLOP/s per dtype, memory bandwidth and capacity. ``get_hardware(name)`` looks one up and
names the profiles when it is unknown. Read-only tables of plain numbers: no torch import,
so the CLI's help can list the profiles at once. Each figure's source is beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "COLLECTIVES", "DTYPE_BYTES", "HARDWARE", "Hardware", "Link", "dtype_bytes", "get_hardware", "canonical_dtype",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


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


def canonical_dtype(name: str) -> str:
    """``"torch.bfloat16"`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"``."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        valid = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r}; expected one of: {valid}")
    return _CANONICAL_DTYPE.get(key, key)


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name`` (``str(torch.float32)`` also works)."""
    return DTYPE_BYTES[canonical_dtype(name)]


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
    # Fixed host time of one collective call, whatever its size and group: DTensor's
    # redistribute, the functional collective and its wait (a base latency, paid once,
    # not once per ring step as alpha is).
    call_s: float = 0.0
    # Measured time of a collective kind over the ring model's on this link (absent: 1):
    # a backend that runs a kind some other way than a ring (gloo emulates reduce_scatter)
    kind_factor: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"Link.alpha_s must be finite and >= 0, got {self.alpha_s!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link.bandwidth must be finite and > 0, got {self.bandwidth!r}")
        if not (self.call_s >= 0 and math.isfinite(self.call_s)):
            raise ValueError(f"Link.call_s must be finite and >= 0, got {self.call_s!r}")
        for kind, factor in self.kind_factor.items():
            if kind not in COLLECTIVES or not (factor > 0 and math.isfinite(factor)):
                raise ValueError(f"Link.kind_factor: {kind!r}: {factor!r}; expected a collective of "
                                 f"{', '.join(COLLECTIVES)} and a factor > 0")


@dataclass(frozen=True)
class Hardware:
    """Per-device figures of one cluster type.

    Bandwidths are bytes/s per direction per device; ``peak_flops`` maps a
    canonical dtype (``fp32``, ``bf16``, ``fp16``, ``fp8``) to dense peak
    FLOP/s, without structured sparsity.

    The two host-overhead figures are the time the Python side of a
    tensor-parallel step adds beyond the kernels and the wire, counted only
    where it is not hidden: on a CPU the host *is* the device, so every
    microsecond of dispatch is step time; on a GPU the host queues kernels
    asynchronously and runs ahead of them, so for models big enough to plan
    for it overlaps the kernels and the profiles charge 0.

    * ``module_overhead_s``: one tensor-parallel module (a Linear, norm or
      embedding under a parallel style), forward + backward: the style's
      input/output hooks and the DTensor dispatch of the module's ops.
    * ``collective_overhead_s``: one collective call (``Link.call_s``).
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
    module_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    collective_factor: dict[str, float] = field(default_factory=dict, hash=False)  # Link.kind_factor

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"{self.name}: devices_per_node must be >= 1")
        for name in ("module_overhead_s", "collective_overhead_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{self.name}: {name} must be finite and >= 0, got {value!r}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"{self.name}: matmul_efficiency must be in (0, 1]")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"{self.name}: memory figures must be > 0")
        for dtype, flops in self.peak_flops.items():
            if canonical_dtype(dtype) != dtype or flops <= 0:
                raise ValueError(f"{self.name}: bad peak_flops entry {dtype!r}: {flops!r}")
        _ = self.intra_link, self.inter_link  # Link validates its own figures

    @property
    def intra_link(self) -> Link:
        """Link between devices of one node."""
        return Link(alpha_s=self.intra_alpha_s, bandwidth=self.intra_bandwidth, call_s=self.collective_overhead_s,
                    kind_factor=self.collective_factor)

    @property
    def inter_link(self) -> Link:
        """Link between nodes, per device."""
        return Link(alpha_s=self.inter_alpha_s, bandwidth=self.inter_bandwidth, call_s=self.collective_overhead_s,
                    kind_factor=self.collective_factor)


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
    # on 2026-12-01 (load average 1-1.5 from other sessions' runs); median of
    # three runs, ranges in brackets. Two gloo ranks over localhost TCP;
    # alpha/beta fitted on all_reduce from 4 KB to 64 MB [alpha 222-274 us,
    # 1.18-1.47 GB/s]; gloo's all_gather and reduce_scatter (which gloo lacks
    # natively) run 1.4x [1.37-1.49] and 2.5x [2.22-2.72] the ring model.
    # FLOP/s are 1024^3 matmuls on one thread, as each rank gets one core
    # [fp32 90-98, bf16 196-219 GFLOP/s; two threads measure ~2x]; a training
    # step's Linear matmuls (512 tokens, 512 <-> 1536), run in both ranks at
    # once, reach 0.99 [0.90-1.03] of that rate: matmul_efficiency.
    # memory_bandwidth: what an AdamW foreach step reaches per rank with both
    # ranks stepping, its counted bytes over its time [17.7-30.4 GB/s; alone
    # 18.6-19.6; a 256 MB copy reaches 24-27 GB/s]. Host overhead on the fake
    # group (calibrate_gloo.measure_dispatch_overhead): 495 us per
    # tensor-parallel module [487-499], 115 us per collective call [111-115].
    # Memory: RAM split over the two ranks. There is no second node:
    # inter-node figures repeat the loopback ones.
    alpha_s, bandwidth = 2.61e-4, 1.18e9
    return Hardware(
        name="cpu-gloo",
        description="2 gloo ranks on one 2-core CPU host (localhost TCP); "
        "figures measured by benchmarks/calibrate_gloo.py",
        devices_per_node=2,
        intra_alpha_s=alpha_s,
        intra_bandwidth=bandwidth,
        inter_alpha_s=alpha_s,
        inter_bandwidth=bandwidth,
        peak_flops={"fp32": 9.55e10, "bf16": 2.10e11},
        matmul_efficiency=0.99,
        memory_bytes=12_638_255_104,
        memory_bandwidth=1.82e10,
        module_overhead_s=4.95e-4,
        collective_overhead_s=1.15e-4,
        collective_factor={"all_gather": 1.43, "reduce_scatter": 2.53},
    )


HARDWARE: dict[str, Hardware] = _profiles()


def get_hardware(name: str) -> Hardware:
    """The built-in profile called ``name``."""
    try:
        return HARDWARE[name]
    except KeyError:
        valid = ", ".join(sorted(HARDWARE))
        raise ValueError(f"unknown hardware profile {name!r}; expected one of: {valid}") from None
