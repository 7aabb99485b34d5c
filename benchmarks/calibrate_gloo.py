"""Calibrate the ``cpu-gloo`` hardware profile of :mod:`shardplan.decide.cost`.

Spawns ``--world-size`` (default 2) gloo processes on localhost, times
``all_reduce`` and ``all_gather`` over message sizes from 4 KB to 64 MB, and
fits the ring alpha-beta model by linear least squares::

    all_reduce:  t = 2(p-1)*alpha + 2(p-1)/p * n * beta
    all_gather:  t =  (p-1)*alpha +  (p-1)/p * n * beta     (n = gathered bytes)

alpha and beta are fitted on the ``all_reduce`` samples only (the collective
the optimizer charges most often); ``all_gather`` is timed against the fitted
model as a check and printed next to it. Gloo's large all_gathers run well
slower than the ring model predicts, so fitting them jointly would skew beta.

It also times 1024^3 matmuls in the main process (fp32 and bf16, 1 and 2
threads) for the peak-FLOP figure and a large copy for the memory bandwidth,
then prints the fitted profile as a Python snippet for ``shardplan/cost.py``.
Per-device figures use the 1-thread numbers: each rank gets one core.
Calibrate on an otherwise idle machine; concurrent load shows up directly in
both alpha and the FLOP figures.

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
import time

# Spinning OpenMP threads in idle ranks steal the only cores from the rank
# doing work; set before torch initialises its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

KIND_STEPS = {"all_reduce": 2.0, "all_gather": 1.0}  # multiplier of (p-1)


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
    """Median seconds of all_reduce and all_gather for an ``n``-byte tensor."""
    full = torch.ones(n // 4, dtype=torch.float32)
    shard = torch.ones(n // 4 // world, dtype=torch.float32)
    gathered = torch.empty(n // 4 // world * world, dtype=torch.float32)  # n bytes
    warmup = 3 if n < 8 * 2**20 else 2
    return {
        "all_reduce": _time_op(lambda: dist.all_reduce(full), reps=reps, warmup=warmup),
        "all_gather": _time_op(
            lambda: dist.all_gather_single(gathered, shard), reps=reps, warmup=warmup
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
    if rank == 0:
        queue.put([(k, n, statistics.median(ts)) for (k, n), ts in per_size.items()])
    # Gloo workers sometimes SIGABRT in static destructors at interpreter exit;
    # synchronise, tear down explicitly and skip the interpreter shutdown.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure_collectives(
    *, world: int, sizes: list[int], reps: int, rounds: int
) -> list[tuple[str, int, float]]:
    """Run the workers and return ``(kind, full_bytes, seconds)`` samples."""
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
    samples = measure_collectives(
        world=args.world_size,
        sizes=message_sizes(args.max_mb),
        reps=args.reps,
        rounds=args.rounds,
    )
    alpha, beta = fit_alpha_beta(samples, world=args.world_size)
    flops = {
        (name, threads): measure_matmul_flops(dtype=dtype, threads=threads)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for threads in (1, 2)
    }
    mem_bw = measure_memory_bandwidth()
    _print_report(samples, alpha=alpha, beta=beta, world=args.world_size)
    for (name, threads), value in flops.items():
        print(f"# matmul 1024^3 {name} {threads} thread(s): {value / 1e9:.1f} GFLOP/s")
    print(f"# copy bandwidth (1 thread, read+write): {mem_bw / 1e9:.2f} GB/s")
    print(f"# elapsed {time.perf_counter() - started:.1f} s\n")
    _print_snippet(
        alpha=alpha, beta=beta, world=args.world_size, mem_bw=mem_bw,
        fp32=flops[("fp32", 1)], bf16=flops[("bf16", 1)],
    )


def _print_report(samples, *, alpha: float, beta: float, world: int) -> None:
    """Measured vs fitted time for each sample, as comment lines."""
    print(f"# {'kind':<11} {'bytes':>10} {'measured':>11} {'model':>11} {'ratio':>6}")
    for kind, n, t in samples:
        k, p = KIND_STEPS[kind], world
        model = k * (p - 1) * alpha + k * (p - 1) / p * n * beta
        print(f"# {kind:<11} {n:>10d} {t * 1e3:>9.3f}ms {model * 1e3:>9.3f}ms {t / model:>6.2f}")


def _print_snippet(
    *, alpha: float, beta: float, world: int, mem_bw: float, fp32: float, bf16: float
) -> None:
    """The ``cpu-gloo`` profile fields, ready to paste into shardplan/cost.py.

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
    print(f"memory_bytes={memory_per_device(world=world)},")
    print(f"memory_bandwidth={mem_bw:.3g},")


if __name__ == "__main__":
    main()
