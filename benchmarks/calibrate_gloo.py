"""Calibrate the ``cpu-gloo`` hardware profile of :mod:`shardplan.decide.cost`.

Spawns ``--world-size`` (default 2) gloo processes on localhost, times
``all_reduce``, ``all_gather`` and ``reduce_scatter`` over message sizes from
4 KB to 64 MB, and fits the ring alpha-beta model by linear least squares::

    all_reduce:      t = 2(p-1)*alpha + 2(p-1)/p * n * beta
    all_gather:      t =  (p-1)*alpha +  (p-1)/p * n * beta   (n = gathered bytes)
    reduce_scatter:  t =  (p-1)*alpha +  (p-1)/p * n * beta   (n = input bytes)

alpha and beta are fitted on the ``all_reduce`` samples only (the collective
the optimizer charges most often). Gloo runs the other two well slower than a
ring (it has no native reduce_scatter), so fitting them jointly would skew
beta; instead each gets its own factor, the median over sizes of measured /
ring model (``collective_factor`` of the profile, ``Link.kind_factor``).

It also times, on one thread per process (each rank gets one core):

* 1024^3 matmuls (fp32 and bf16; 2 threads for reference) for the peak-FLOP
  figure;
* in every rank at once (as a training step runs them: the ranks share the
  host's memory bus), the forward + backward matmuls of training-shaped
  Linears (512 tokens, 512 <-> 1536 features) for ``matmul_efficiency``, and
  one ``AdamW(foreach=True)`` step over 8M parameters, whose counted traffic
  (``cost.optimizer_step_bytes``) over its time is the bandwidth torch's
  elementwise kernels reach: ``memory_bandwidth`` (both also alone in the
  main process, and a large copy, for reference);
* on the fake process group, the host overhead of tensor parallelism
  (``collective_overhead_s`` per collective call, ``module_overhead_s`` per
  module; see ``measure_dispatch_overhead``).

It then prints the fitted profile as a Python snippet for
``shardplan/decide/hardware.py``. Calibrate on an otherwise idle machine;
concurrent load shows up directly in alpha, the FLOP and the bandwidth figures.

Usage::

    python benchmarks/calibrate_gloo.py [--world-size 2] [--reps 15] [--rounds 3] [--max-mb 64]

Runs in well under a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_module
import socket
import statistics
import sys
import time

# Spinning OpenMP threads in idle ranks steal the only cores from the rank
# doing work; set before torch initialises its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

KIND_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}  # multiplier of (p-1)


def free_port() -> int:
    """Return a TCP port the OS reports free (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def message_sizes(max_mb: int) -> list[int]:
    """Powers of four from 4 KB up to ``max_mb`` MB (inclusive), in bytes."""
    sizes, n = [], 4 * 1024
    while n <= max_mb * 1024 * 1024:
        sizes.append(n)
        n *= 4
    return sizes


def _time_op(op, *, reps: int, warmup: int) -> float:
    """Median wall time of ``op`` across ranks (max over ranks per rep)."""
    for _ in range(warmup):
        op()
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        op()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed.item()))
    return statistics.median(samples)


def _time_size(n: int, *, world: int, reps: int) -> dict[str, float]:
    """Median seconds of all_reduce, all_gather and reduce_scatter for ``n`` logical bytes."""
    full = torch.ones(n // 4, dtype=torch.float32)
    shard = torch.ones(n // 4 // world, dtype=torch.float32)
    gathered = torch.empty(n // 4 // world * world, dtype=torch.float32)  # n bytes
    scattered = torch.empty(n // 4 // world, dtype=torch.float32)
    warmup = 3 if n < 8 * 2**20 else 2
    return {
        "all_reduce": _time_op(lambda: dist.all_reduce(full), reps=reps, warmup=warmup),
        "all_gather": _time_op(
            lambda: dist.all_gather_into_tensor(gathered, shard), reps=reps, warmup=warmup
        ),
        "reduce_scatter": _time_op(
            lambda: dist.reduce_scatter_tensor(scattered, gathered), reps=reps, warmup=warmup
        ),
    }


def _worker(
    rank: int, world: int, port: int, sizes: list[int], reps: int, rounds: int, queue
) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # Connection set-up and allocator warm-up inflate the first timed calls.
    _time_op(lambda: dist.all_reduce(torch.ones(1024)), reps=3, warmup=10)
    # Several passes over the size sweep, median per size across passes: a
    # burst of OS noise on 2 shared cores then spoils one pass, not a size.
    per_size: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for n in sizes:
            for kind, seconds in _time_size(n, world=world, reps=reps).items():
                per_size.setdefault((kind, n), []).append(seconds)
    # Compute and memory figures with every rank working at once, as in a training step:
    # the ranks share the host's memory bus (a GPU has its own HBM; these do not).
    dist.barrier()
    linear = measure_linear_flops()
    dist.barrier()
    bandwidth = measure_optimizer_bandwidth()
    together = torch.tensor([linear, bandwidth], dtype=torch.float64)
    dist.all_reduce(together)  # mean over ranks
    if rank == 0:
        samples = [(k, n, statistics.median(ts)) for (k, n), ts in per_size.items()]
        queue.put((samples, *(together / world).tolist()))
    # Gloo workers sometimes SIGABRT in static destructors at interpreter exit;
    # synchronise, tear down explicitly and skip the interpreter shutdown.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure_collectives(
    *, world: int, sizes: list[int], reps: int, rounds: int
) -> tuple[list[tuple[str, int, float]], float, float]:
    """Run the workers; return their ``(kind, full_bytes, seconds)`` samples, and the
    Linear-matmul FLOP/s and AdamW bandwidth each rank reaches with all ranks running."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, sizes, reps, rounds, queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    while True:  # poll, so a crashed worker fails the run instead of hanging it
        try:
            results = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                codes = [proc.exitcode for proc in procs]
                raise RuntimeError(f"calibration worker failed, exit codes {codes}") from None
    for proc in procs:
        proc.join(timeout=60)
    return results


def _lstsq_alpha_beta(samples: list[tuple[str, int, float]], *, world: int) -> tuple[float, float]:
    """Least squares on relative error for ``t = k(p-1)*alpha + k(p-1)/p*n*beta``.

    Rows are divided by ``t`` so 4 KB and 64 MB samples weigh equally
    (otherwise the large messages alone decide alpha, which then goes negative).
    """
    p = world
    rows = [
        [KIND_STEPS[k] * (p - 1) / t, KIND_STEPS[k] * (p - 1) / p * n / t]
        for k, n, t in samples
    ]
    solution = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64), torch.ones(len(rows), 1, dtype=torch.float64)
    ).solution
    return max(float(solution[0]), 1e-7), float(solution[1])


def fit_alpha_beta(samples: list[tuple[str, int, float]], *, world: int) -> tuple[float, float]:
    """Fit ``t = 2(p-1)*alpha + 2(p-1)/p*n*beta`` to the all_reduce samples.

    On a 2-core VM small collectives are bimodal: ~0.3 ms normally, ~3-4 ms
    when a rank's wake-up slips by a scheduler tick. A size whose median lands
    in the slow mode is an outlier for the alpha-beta model, so points more
    than 2x off the first fit are dropped and the fit is redone once.
    """
    reduce_samples = [s for s in samples if s[0] == "all_reduce"]
    alpha, beta = _lstsq_alpha_beta(reduce_samples, world=world)
    p = world
    kept = [
        (k, n, t)
        for k, n, t in reduce_samples
        if 0.5 <= t / (2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta) <= 2.0
    ]
    if len(kept) >= 3:
        alpha, beta = _lstsq_alpha_beta(kept, world=world)
    return alpha, beta


def _ring_model(kind: str, n: int, *, alpha: float, beta: float, world: int) -> float:
    k, p = KIND_STEPS[kind], world
    return k * (p - 1) * alpha + k * (p - 1) / p * n * beta


def fit_kind_factors(
    samples: list[tuple[str, int, float]], *, alpha: float, beta: float, world: int
) -> dict[str, float]:
    """Per collective kind other than all_reduce: median over sizes of measured / ring model."""
    ratios: dict[str, list[float]] = {}
    for kind, n, t in samples:
        if kind != "all_reduce":
            ratios.setdefault(kind, []).append(t / _ring_model(kind, n, alpha=alpha, beta=beta, world=world))
    return {kind: statistics.median(r) for kind, r in sorted(ratios.items())}


def measure_matmul_flops(
    *, dtype: torch.dtype = torch.float32, size: int = 1024, threads: int = 2, reps: int = 10
) -> float:
    """Best-of-``reps`` FLOP/s for a ``size``^3 matmul (2*size^3 flops)."""
    torch.set_num_threads(threads)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def measure_memory_bandwidth(
    *, num_bytes: int = 256 * 2**20, threads: int = 1, reps: int = 5
) -> float:
    """Best-of-``reps`` bytes/s of ``dst.copy_(src)``, counting read + write."""
    torch.set_num_threads(threads)
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2.0 * num_bytes / best


def _best(fn, *, reps: int, warmup: int = 3) -> float:
    """Fastest of ``reps`` timed calls (after ``warmup``): the least disturbed run."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_linear_flops(*, tokens: int = 512, dim: int = 512, hidden: int = 1536, reps: int = 10) -> float:
    """FLOP/s of a training step's Linear matmuls on one thread: forward (x W^T), input
    gradient (dy W) and weight gradient (dy^T x) of ``tokens x dim -> hidden`` and of
    ``hidden -> dim``, 3 * 2 * tokens * dim * hidden flops each Linear."""
    torch.set_num_threads(1)
    total_flops = total_s = 0.0
    for n_in, n_out in ((dim, hidden), (hidden, dim)):
        x, w, dy = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
        for op in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
            total_s += _best(op, reps=reps)
        total_flops += 3 * 2 * tokens * n_in * n_out
    return total_flops / total_s


def measure_optimizer_bandwidth(*, num_params: int = 8 * 2**20, tensors: int = 32, reps: int = 5) -> float:
    """Bytes/s one ``AdamW(foreach=True)`` step streams on one thread: the traffic
    ``cost.optimizer_step_bytes`` counts per parameter, over the step's best time."""
    from shardplan.decide import cost

    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(num_params // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    seconds = _best(opt.step, reps=reps)
    return num_params * cost.optimizer_step_bytes(optimizer="adamw") / seconds


def measure_dispatch_overhead(*, dim: int = 64, tokens: int = 8, reps: int = 200) -> tuple[float, float]:
    """``(module_overhead_s, collective_overhead_s)``: the host time tensor parallelism adds
    on this machine, measured on the fake process group (its collectives return at once,
    so what is left is DTensor's Python dispatch) at tiny shapes, where the kernels' own
    time is negligible:

    * per collective call: the mean over DTensor's three redistributions a plan issues
      (``Partial -> Replicate`` all-reduce, ``Shard(1) -> Replicate`` all-gather,
      ``Partial -> Shard(1)`` reduce-scatter) minus a raw ``dist.all_reduce``;
    * per module: the mean over the styles a transformer plan applies (``ColwiseParallel``
      and ``RowwiseParallel`` Linears, a ``ReplicateParallel`` and a ``SequenceParallel``
      RMSNorm) of forward + backward minus the same module on plain tensors of its local
      shapes, less the one collective call each Linear makes (rowwise's output all-reduce,
      colwise's input-gradient all-reduce).
    """
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    from shardplan.apply.mesh import fake_process_group, make_mesh
    from shardplan.apply.styles import ReplicateParallel

    torch.set_num_threads(1)

    def timed(fn) -> float:
        return _best(fn, reps=reps, warmup=20)

    with fake_process_group(2):
        mesh = make_mesh({"tp": 2})
        small = torch.randn(1, tokens, dim)
        raw = timed(lambda: dist.all_reduce(small))
        calls = []
        for src, dst in (([Partial()], [Replicate()]), ([Shard(1)], [Replicate()]), ([Partial()], [Shard(1)])):
            t = DTensor.from_local(small, mesh, src, run_check=False)
            calls.append(timed(lambda t=t, dst=dst: t.redistribute(mesh, dst).to_local()) - raw)
        collective = max(statistics.mean(calls), 0.0)

        def x(features: int, seq: int = tokens) -> torch.Tensor:
            return torch.randn(1, seq, features, requires_grad=True)

        # (parallel module, its input, plain module of the local shapes, its input, collective calls)
        cases = [
            (parallelize_module(nn.Linear(dim, dim, bias=False), mesh, ColwiseParallel()), x(dim),
             nn.Linear(dim, dim // 2, bias=False), x(dim), 1),
            (parallelize_module(nn.Linear(dim, dim, bias=False), mesh, RowwiseParallel()), x(dim // 2),
             nn.Linear(dim // 2, dim, bias=False), x(dim // 2), 1),
            (parallelize_module(nn.RMSNorm(dim), mesh, ReplicateParallel()), x(dim), nn.RMSNorm(dim), x(dim), 0),
            (parallelize_module(nn.RMSNorm(dim), mesh, SequenceParallel(use_local_output=True)), x(dim),
             nn.RMSNorm(dim), x(dim, tokens // 2), 0),
        ]
        extra = [
            timed(lambda m=m, a=a: m(a).sum().backward()) - timed(lambda m=p, a=b: m(a).sum().backward()) - n * collective
            for m, a, p, b, n in cases
        ]
    return max(statistics.mean(extra), 0.0), collective


def memory_per_device(*, world: int) -> int:
    """Physical RAM split evenly over ``world`` ranks."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-mb", type=int, default=64)
    args = parser.parse_args()

    started = time.perf_counter()
    samples, linear, mem_bw = measure_collectives(
        world=args.world_size,
        sizes=message_sizes(args.max_mb),
        reps=args.reps,
        rounds=args.rounds,
    )
    alpha, beta = fit_alpha_beta(samples, world=args.world_size)
    factors = fit_kind_factors(samples, alpha=alpha, beta=beta, world=args.world_size)
    flops = {
        (name, threads): measure_matmul_flops(dtype=dtype, threads=threads)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for threads in (1, 2)
    }
    alone = {"linear": measure_linear_flops(), "adamw": measure_optimizer_bandwidth()}
    copy_bw = measure_memory_bandwidth()
    module_s, collective_s = measure_dispatch_overhead()
    _print_report(samples, alpha=alpha, beta=beta, world=args.world_size)
    for (name, threads), value in flops.items():
        print(f"# matmul 1024^3 {name} {threads} thread(s): {value / 1e9:.1f} GFLOP/s")
    print(f"# training-shaped Linear matmuls fp32 1 thread: {alone['linear'] / 1e9:.1f} GFLOP/s alone, "
          f"{linear / 1e9:.1f} per rank with {args.world_size} ranks at once "
          f"({linear / flops[('fp32', 1)]:.2f} of the 1024^3 rate)")
    print(f"# copy bandwidth (1 thread, read+write): {copy_bw / 1e9:.2f} GB/s; AdamW foreach step "
          f"(counted bytes / time): {alone['adamw'] / 1e9:.2f} GB/s alone, {mem_bw / 1e9:.2f} per rank at once")
    print(f"# host overhead (fake group): {module_s * 1e6:.0f} us per module, "
          f"{collective_s * 1e6:.0f} us per collective call")
    print(f"# elapsed {time.perf_counter() - started:.1f} s\n")
    _print_snippet(
        alpha=alpha, beta=beta, world=args.world_size, mem_bw=mem_bw,
        fp32=flops[("fp32", 1)], bf16=flops[("bf16", 1)],
        efficiency=min(linear / flops[("fp32", 1)], 1.0), module_s=module_s, collective_s=collective_s,
        factors=factors,
    )


def _print_report(samples, *, alpha: float, beta: float, world: int) -> None:
    """Measured vs fitted time for each sample, as comment lines."""
    print(f"# {'kind':<14} {'bytes':>10} {'measured':>11} {'ring model':>11} {'ratio':>6}")
    for kind, n, t in samples:
        model = _ring_model(kind, n, alpha=alpha, beta=beta, world=world)
        print(f"# {kind:<14} {n:>10d} {t * 1e3:>9.3f}ms {model * 1e3:>9.3f}ms {t / model:>6.2f}")


def _print_snippet(
    *, alpha: float, beta: float, world: int, mem_bw: float, fp32: float, bf16: float,
    efficiency: float, module_s: float, collective_s: float, factors: dict[str, float],
) -> None:
    """The ``cpu-gloo`` profile fields, ready to paste into shardplan/decide/hardware.py.

    Per-device compute and memory figures are single-thread ones: with one
    rank per core, that is what each simulated device gets.
    """
    today = datetime.date.today().isoformat()
    print(f"# Measured by `python benchmarks/calibrate_gloo.py` on {today}")
    print(f"# (world size {world}, torch {torch.__version__}).")
    print(f"devices_per_node={world},")
    print(f"intra_alpha_s={alpha:.3g},")
    print(f"intra_bandwidth={1.0 / beta:.3g},  # bytes/s per direction")
    print(f'peak_flops={{"fp32": {fp32:.3g}, "bf16": {bf16:.3g}}},  # per rank, 1 thread')
    print(f"matmul_efficiency={efficiency:.2f},")
    print(f"memory_bytes={memory_per_device(world=world)},")
    print(f"memory_bandwidth={mem_bw:.3g},")
    print(f"module_overhead_s={module_s:.3g},")
    print(f"collective_overhead_s={collective_s:.3g},")
    print("collective_factor={" + ", ".join(f'"{k}": {v:.2f}' for k, v in factors.items()) + "},")


if __name__ == "__main__":
    main()
