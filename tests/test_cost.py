"""Tests for shardplan.decide.cost: formulas against hand-computed numbers."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import shardplan

from shardplan.decide import cost
from shardplan.decide.cost import (
    COLLECTIVES,
    HARDWARE,
    Link,
    activation_bytes_per_layer,
    axis_links,
    collective_bytes,
    collective_time,
    dtype_bytes,
    format_bytes,
    format_seconds,
    get_hardware,
    matmul_time,
    memory_time,
    param_state_bytes,
    parse_bytes,
    training_bytes_per_param,
)

LINK = Link(alpha_s=1e-5, bandwidth=1e9)  # 10 us per step, 1 GB/s
N = 8_000_000  # 8 MB logical tensor


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fp32", 4), ("float32", 4), ("bf16", 2), ("bfloat16", 2), ("fp16", 2),
     ("float16", 2), ("fp8", 1), ("torch.float32", 4), ("torch.bfloat16", 2)],
)  # fmt: skip
def test_dtype_bytes(name: str, expected: int) -> None:
    assert dtype_bytes(name) == expected


def test_dtype_bytes_unknown_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'int8'.*bf16.*fp32"):
        dtype_bytes("int8")


# ---------------------------------------------------------------- collectives


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_group_of_one_is_free(kind: str) -> None:
    assert collective_time(kind, N, group_size=1, link=LINK) == 0.0
    assert collective_bytes(kind, N, group_size=1) == 0.0


@pytest.mark.parametrize(
    ("kind", "p", "expected_s"),
    [
        # all_reduce: 2(p-1)a + 2(p-1)/p * n/B
        ("all_reduce", 2, 2 * 1e-5 + 8e-3),  # 0.00802
        ("all_reduce", 8, 14 * 1e-5 + 14e-3),  # 0.01414
        # (p-1)a + (p-1)/p * n/B
        ("all_gather", 2, 1e-5 + 4e-3),
        ("all_gather", 8, 7e-5 + 7e-3),
        ("reduce_scatter", 2, 1e-5 + 4e-3),
        ("reduce_scatter", 8, 7e-5 + 7e-3),
        ("all_to_all", 2, 1e-5 + 4e-3),
        ("all_to_all", 8, 7e-5 + 7e-3),
    ],
)
def test_collective_time_hand_computed(kind: str, p: int, expected_s: float) -> None:
    assert collective_time(kind, N, group_size=p, link=LINK) == pytest.approx(expected_s, rel=1e-12)


@pytest.mark.parametrize(
    ("kind", "p", "expected"),
    [("all_reduce", 2, 8e6), ("all_reduce", 8, 14e6), ("all_gather", 2, 4e6),
     ("all_gather", 8, 7e6), ("reduce_scatter", 8, 7e6), ("all_to_all", 8, 7e6)],
)  # fmt: skip
def test_collective_bytes_hand_computed(kind: str, p: int, expected: float) -> None:
    assert collective_bytes(kind, N, group_size=p) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    for p in (2, 3, 8, 64):
        rs = collective_time("reduce_scatter", N, group_size=p, link=LINK)
        ag = collective_time("all_gather", N, group_size=p, link=LINK)
        ar = collective_time("all_reduce", N, group_size=p, link=LINK)
        assert ar == pytest.approx(rs + ag, rel=1e-12)


def test_h100_all_reduce_1gb_over_8_gpus() -> None:
    link = get_hardware("h100-nvlink").intra_link
    # 14 * 4 us + 2*7/8 * 1e9 B / 450e9 B/s = 56 us + 3.8889 ms
    expected = 14 * 4e-6 + 1.75e9 / 450e9
    assert collective_time("all_reduce", 1e9, group_size=8, link=link) == pytest.approx(expected)
    assert expected == pytest.approx(3.9449e-3, rel=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "broadcast", "num_bytes": N, "group_size": 2}, "unknown collective 'broadcast'"),
        ({"kind": "all_reduce", "num_bytes": N, "group_size": 0}, "group_size"),
        ({"kind": "all_reduce", "num_bytes": N, "group_size": 2.0}, "group_size"),
        ({"kind": "all_reduce", "num_bytes": -1, "group_size": 2}, "num_bytes"),
    ],
)
def test_collective_bad_arguments(kwargs: dict, match: str) -> None:
    kind, n = kwargs.pop("kind"), kwargs.pop("num_bytes")
    with pytest.raises(ValueError, match=match):
        collective_time(kind, n, link=LINK, **kwargs)
    with pytest.raises(ValueError, match=match):
        collective_bytes(kind, n, **kwargs)


def test_link_rejects_nonpositive_bandwidth() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Link(alpha_s=1e-6, bandwidth=0)


# ---------------------------------------------------------------- axis links


def test_axis_links_single_node_tp() -> None:
    hw = get_hardware("h100-ib")
    assert axis_links(hw, {"tp": 8}) == {"tp": hw.intra_link}


def test_axis_links_dp_spans_nodes_tp_stays_inside() -> None:
    hw = get_hardware("h100-ib")
    links = axis_links(hw, {"dp": 16, "tp": 8})
    assert list(links) == ["dp", "tp"]  # caller's order kept
    assert links["tp"] == hw.intra_link
    assert links["dp"] == hw.inter_link
    assert hw.intra_link != hw.inter_link


def test_axis_links_tp_larger_than_a_node_is_inter() -> None:
    hw = get_hardware("h100-ib")
    assert axis_links(hw, {"tp": 16}) == {"tp": hw.inter_link}


def test_axis_links_small_outer_axis_stays_inside() -> None:
    hw = get_hardware("a100")
    # 2 * 4 = 8 devices: the whole mesh fits one node.
    assert axis_links(hw, {"dp": 2, "tp": 4}) == {"dp": hw.intra_link, "tp": hw.intra_link}
    # 2 * 8 = 16: the outer axis now crosses nodes, even though it is only 2.
    assert axis_links(hw, {"dp": 2, "tp": 8})["dp"] == hw.inter_link


def test_axis_links_bad_size() -> None:
    with pytest.raises(ValueError, match="'tp'"):
        axis_links(get_hardware("a100"), {"tp": 0})


# ---------------------------------------------------------------- hardware


def test_builtin_profiles_present() -> None:
    assert {"h100-nvlink", "h100-ib", "a100", "pcie", "cpu-gloo"} <= set(HARDWARE)
    for name, hw in HARDWARE.items():
        assert hw.name == name
        assert get_hardware(name) is hw


def test_h100_figures() -> None:
    hw = get_hardware("h100-nvlink")
    assert hw.devices_per_node == 8
    assert hw.intra_bandwidth == 450e9
    assert hw.peak_flops["bf16"] == 989e12
    assert hw.memory_bandwidth == 3.35e12
    assert get_hardware("h100-ib").inter_bandwidth == 50e9


def test_cpu_gloo_profile_is_plausible() -> None:
    hw = get_hardware("cpu-gloo")
    assert hw.devices_per_node == 2
    assert 1e-6 < hw.intra_alpha_s < 1e-2  # loopback TCP: tens to hundreds of us
    assert 1e8 < hw.intra_bandwidth < 1e11
    assert 1e9 < hw.peak_flops["fp32"] < 1e13


def test_get_hardware_unknown() -> None:
    expected = r"unknown hardware profile 'tpu-v5'; expected one of: .*a100"
    with pytest.raises(ValueError, match=expected):
        get_hardware("tpu-v5")


def test_hardware_validates() -> None:
    hw = get_hardware("a100")
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(hw, matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        dataclasses.replace(hw, peak_flops={"float32": 1e12})  # keys must be canonical
    assert hash(hw) == hash(dataclasses.replace(hw))  # usable as a cache key


# ---------------------------------------------------------------- compute


def test_matmul_time() -> None:
    hw = get_hardware("h100-ib")
    # flops / (peak * efficiency): 989e12 * 0.6 flops take exactly one second.
    assert matmul_time(989e12 * 0.6, hardware=hw, dtype="bf16") == pytest.approx(1.0)
    assert matmul_time(67e12 * 0.6, hardware=hw, dtype="float32") == pytest.approx(1.0)


def test_matmul_time_dtype_without_peak() -> None:
    with pytest.raises(ValueError, match=r"a100 has no peak FLOP/s for 'fp8'"):
        matmul_time(1e12, hardware=get_hardware("a100"), dtype="fp8")


def test_memory_time() -> None:
    hw = get_hardware("h100-ib")
    assert memory_time(3.35e12, hardware=hw) == pytest.approx(1.0)
    assert memory_time(0, hardware=hw) == 0.0


# ---------------------------------------------------------------- memory


def test_training_bytes_per_param_adamw() -> None:
    assert training_bytes_per_param(dtype="bf16") == 16  # 2 + 2 + 12
    assert training_bytes_per_param(dtype="fp32") == 16  # 4 + 4 + 8
    assert training_bytes_per_param(dtype="bf16", optimizer="adamw-mixed") == 16
    assert param_state_bytes(dtype="bf16") == cost.ParamStateBytes(param=2, grad=2, optimizer=12)
    assert param_state_bytes(dtype="fp32") == cost.ParamStateBytes(param=4, grad=4, optimizer=8)


def test_training_bytes_per_param_other_optimizers() -> None:
    assert training_bytes_per_param(dtype="bf16", optimizer="sgd") == 8  # 2 + 2 + master 4
    assert training_bytes_per_param(dtype="fp32", optimizer="sgd") == 8  # 4 + 4
    assert training_bytes_per_param(dtype="fp32", optimizer="sgd-momentum") == 12
    assert training_bytes_per_param(dtype="bf16", optimizer="none") == 2
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        training_bytes_per_param(dtype="bf16", optimizer="lion")


# s=2048, b=1, h=4096, a=32 -> s*b*h = 8_388_608 and 5*a*s/h = 80.
SHAPE = {"seq_len": 2048, "batch_size": 1, "hidden": 4096, "num_heads": 32}


def test_activation_bytes_hand_computed() -> None:
    assert activation_bytes_per_layer(**SHAPE) == 8_388_608 * 114  # 34 + 80
    # TP 8 without SP: 10 + 24/8 + 80/8 = 23
    assert activation_bytes_per_layer(**SHAPE, tp=8) == 8_388_608 * 23
    # TP 8 with SP: 114 / 8
    assert activation_bytes_per_layer(**SHAPE, tp=8, sequence_parallel=True) == 8_388_608 * 114 / 8


def test_activation_tp1_equals_no_tp() -> None:
    base = activation_bytes_per_layer(**SHAPE)
    assert activation_bytes_per_layer(**SHAPE, tp=1, sequence_parallel=False) == base
    assert activation_bytes_per_layer(**SHAPE, tp=1, sequence_parallel=True) == base


@pytest.mark.parametrize("t", [2, 4, 8, 16])
def test_activation_sequence_parallel_is_exactly_one_over_t(t: int) -> None:
    base = activation_bytes_per_layer(**SHAPE)
    sp = activation_bytes_per_layer(**SHAPE, tp=t, sequence_parallel=True)
    no_sp = activation_bytes_per_layer(**SHAPE, tp=t)
    assert sp == pytest.approx(base / t, rel=1e-15)
    # Without SP the 10*s*b*h replicated part (LayerNorm/dropout inputs) stays.
    assert no_sp - sp == pytest.approx(8_388_608 * 10 * (1 - 1 / t), rel=1e-12)


def test_activation_scales_with_dtype_bytes() -> None:
    fp32 = activation_bytes_per_layer(**SHAPE, dtype_bytes=4)
    assert fp32 == 2 * activation_bytes_per_layer(**SHAPE)


def test_activation_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tp"):
        activation_bytes_per_layer(**SHAPE, tp=0)
    with pytest.raises(ValueError, match="hidden"):
        activation_bytes_per_layer(**{**SHAPE, "hidden": 0})


# ---------------------------------------------------------------- parse / format


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5TB", 1_500_000_000_000),
        ("4096", 4096),
        (4096, 4096),
        (" 80 gib ", 80 * 2**30),
        ("2KiB", 2048),
        ("1e3", 1000),
        ("0.5GiB", 2**29),
        ("10B", 10),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GB", "80XB", "-1GB", "80 G B", "1.5", "eighty GB", True, None]
)
def test_parse_bytes_errors(text: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(text)  # type: ignore[arg-type]
    assert repr(text) in str(info.value)
    assert "e.g." in str(info.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (1.23 * 2**30, "1.23 GiB"),
     (80 * 10**9, "74.51 GiB"), (2**20 - 1, "1.00 MiB"), (-2048, "-2.00 KiB")],
)  # fmt: skip
def test_format_bytes(n: float, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    ("s", "expected"),
    [(0, "0 s"), (1.2e-3, "1.2 ms"), (3.4e-4, "340 us"), (2.5, "2.5 s"), (5e-9, "5 ns"),
     (0.99999, "1 s"), (1234.5, "1234 s")],
)  # fmt: skip
def test_format_seconds(s: float, expected: str) -> None:
    assert format_seconds(s) == expected


# ---------------------------------------------------------------- calibration fit


def _load_calibration_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate_gloo.py"
    spec = importlib.util.spec_from_file_location("calibrate_gloo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_fit_recovers_alpha_beta() -> None:
    pytest.importorskip("torch")
    calib = _load_calibration_module()
    alpha, bandwidth, p = 1.5e-4, 2e9, 2
    sizes = calib.message_sizes(64)
    assert sizes[0] == 4096 and sizes[-1] == 64 * 2**20
    samples = [
        ("all_reduce", n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bandwidth) for n in sizes
    ]
    # A slow-mode outlier (scheduler tick) and all_gather samples must not move the fit.
    samples[2] = ("all_reduce", sizes[2], 4e-3)
    samples.append(("all_gather", 2**26, 1.0))
    fit_alpha, fit_beta = calib.fit_alpha_beta(samples, world=p)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert 1 / fit_beta == pytest.approx(bandwidth, rel=1e-6)
    assert math.isfinite(calib.measure_matmul_flops(size=64, threads=1, reps=2))


# ---------------------------------------------------------------- step-time terms against torch's own counts


def _bytes_moved(fn) -> int:
    """Bytes the aten ops ``fn`` runs read and write, as torch dispatches them: every tensor
    operand read, every result (or, for an in-place op, every mutated operand) written;
    views move nothing."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def nbytes(tree) -> int:
        return sum(t.nbytes for t in tree_leaves(tree) if isinstance(t, torch.Tensor))

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if not writes and schema.returns and all(r.alias_info is not None for r in schema.returns):
                return out  # a view
            named = {**dict(zip((a.name for a in schema.arguments), args)), **kwargs}
            written = sum(nbytes(named.get(w)) for w in writes) if writes else nbytes(out)
            Count.total += nbytes((args, kwargs)) + written
            return out

    with Count():
        fn()
    return Count.total


@pytest.mark.parametrize(
    ("optimizer", "make"),
    [("adamw", lambda ps, torch: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
     ("sgd-momentum", lambda ps, torch: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
     ("sgd", lambda ps, torch: torch.optim.SGD(ps, lr=0.1, foreach=True))],
)  # fmt: skip
def test_optimizer_step_bytes_match_torch_foreach_step(optimizer: str, make) -> None:
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.randn(512, 512)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params, torch)
    opt.step()  # the first step creates the state; steady state is what a run repeats
    per_param = _bytes_moved(opt.step) / sum(p.numel() for p in params)
    # the per-tensor step counters add a few bytes per tensor, nothing per parameter
    assert per_param == pytest.approx(cost.optimizer_step_bytes(optimizer=optimizer), rel=1e-3)
    hw = get_hardware("h100-ib")
    assert cost.optimizer_time(1e9, hardware=hw, optimizer=optimizer) == pytest.approx(
        1e9 * per_param / hw.memory_bandwidth, rel=1e-3
    )
    assert cost.optimizer_step_bytes(optimizer="none") == 0.0
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        cost.optimizer_step_bytes(optimizer="lion")


@pytest.mark.parametrize("op", ["silu", "mul"])
def test_elementwise_backward_is_about_twice_the_forward_traffic(op: str) -> None:
    torch = pytest.importorskip("torch")
    x, y = (torch.randn(256, 1024, requires_grad=True) for _ in range(2))
    run = (lambda: torch.nn.functional.silu(x)) if op == "silu" else (lambda: x * y)
    forward = _bytes_moved(lambda: run().detach())
    both = _bytes_moved(lambda: run().backward(torch.ones(256, 1024)))
    hw = get_hardware("h100-ib")
    # silu: 2 tensors forward, 3 backward (dy, x -> dx): 2.5x; mul: 3 and 6: 3x
    assert cost.elementwise_time(forward, hardware=hw) == pytest.approx(memory_time(both, hardware=hw), rel=0.2)


def test_collective_time_call_overhead_and_kind_factor() -> None:
    link = Link(alpha_s=1e-5, bandwidth=1e9, call_s=1e-4, kind_factor={"reduce_scatter": 3.0})
    # call once + the ring terms: all_reduce 2(p-1)a + 2(p-1)/p n/B; reduce_scatter 3x its ring
    assert collective_time("all_reduce", N, group_size=2, link=link) == pytest.approx(1e-4 + 2e-5 + 8e-3)
    assert collective_time("reduce_scatter", N, group_size=2, link=link) == pytest.approx(1e-4 + 3 * (1e-5 + 4e-3))
    assert collective_time("all_reduce", N, group_size=1, link=link) == 0.0
    with pytest.raises(ValueError, match="kind_factor"):
        Link(alpha_s=1e-5, bandwidth=1e9, kind_factor={"broadcast": 2.0})
    gloo = get_hardware("cpu-gloo")
    assert gloo.intra_link.call_s == gloo.collective_overhead_s > 0
    assert gloo.intra_link.kind_factor == gloo.collective_factor


def test_linear_step_time_is_its_flops_update_and_dispatch() -> None:
    """One Linear planned at tp=2: its predicted compute is FlopCounterMode's count of its
    forward and backward (dx and dW) over the device's FLOP rate, split over 2 ranks, plus
    AdamW's pass over the half of the weight a rank holds, plus one module's dispatch."""
    torch = pytest.importorskip("torch")
    import shardplan
    from torch.utils.flop_counter import FlopCounterMode

    model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False))
    x = torch.randn(4, 32, 256, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(x.detach(),), hardware="cpu-gloo", explain=False)
    hw = get_hardware("cpu-gloo")
    local_params = 256 * 512 / 2
    assert plan.estimate.param_bytes_per_device == 4 * local_params
    expected = (
        counter.get_total_flops() / 2 / (hw.peak_flops["fp32"] * hw.matmul_efficiency)
        + cost.optimizer_time(local_params, hardware=hw, optimizer="adamw")
        + hw.module_overhead_s
    )
    assert plan.estimate.compute_time_s == pytest.approx(expected, rel=1e-4)


def test_attention_flops_match_torch_flop_counter() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    k = torch.randn(2, 4, 48, 32, requires_grad=True)
    v = torch.randn(2, 4, 48, 16, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    flops = cost.attention_flops(batch=2, heads=4, seq_q=64, seq_k=48, head_dim=32, value_dim=16)
    assert flops == counter.get_total_flops()
    with pytest.raises(ValueError, match="seq_k"):
        cost.attention_flops(batch=2, heads=4, seq_q=64, seq_k=0, head_dim=32)


def test_calibration_kind_factors_are_measured_over_ring_model() -> None:
    pytest.importorskip("torch")
    calib = _load_calibration_module()
    alpha, beta, p = 2e-4, 1 / 1.5e9, 2
    ring = {n: (p - 1) * alpha + (p - 1) / p * n * beta for n in calib.message_sizes(16)}
    samples = [("all_reduce", n, 2 * t) for n, t in ring.items()]  # all_reduce: twice the steps and bytes
    samples += [("all_gather", n, 1.4 * t) for n, t in ring.items()]
    samples += [("reduce_scatter", n, 2.5 * t) for n, t in ring.items()]
    samples[-1] = ("reduce_scatter", samples[-1][1], 100.0)  # one stalled size: the median ignores it
    factors = calib.fit_kind_factors(samples, alpha=alpha, beta=beta, world=p)
    assert factors == pytest.approx({"all_gather": 1.4, "reduce_scatter": 2.5})


def test_weights_a_called_block_never_calls_are_counted_whole() -> None:
    """A decoder-only run of an encoder-decoder layer never calls its cross-attention: those
    weights stay whole on every rank, in every folded copy of the layer, and the estimate
    says so (it counted none of them while the layer itself was called)."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False)
            self.cross = nn.Linear(64, 64, bias=False)  # only with an encoder's output

        def forward(self, x, memory=None):
            if memory is not None:
                x = x + self.cross(memory)
            return x + self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta"):
        model = Stack()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(torch.zeros(2, 8, 64, device="meta"),), explain=False)
    assert plan.module_styles()["layers.2.cross"] == "replicate"
    sharded, whole = 4 * 2 * 64 * 256 * 4 / 4, 4 * 64 * 64 * 4  # up and down split 4 ways; cross whole, fp32
    assert plan.estimate.param_bytes_per_device == sharded + whole
