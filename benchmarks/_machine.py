"""How busy the shared 2-core machine is right now, for the header/footer of each benchmark.

Other people's test runs share the cores, so absolute timings move by 2-3x from minute to
minute. Each benchmark prints this line at its start and end: the 1-minute load average
and a 1-thread 1024^3 fp32 matmul rate, to compare with the 113 GFLOP/s that
``calibrate_gloo.py`` measured on the idle machine (the ``cpu-gloo`` profile).
"""

from __future__ import annotations

import os
import time

IDLE_GFLOPS = 113.0  # shardplan/cost.py, cpu-gloo peak_flops["fp32"]


def speed_note() -> str:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(1024, 1024)
        a @ a
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    gflops = 2 * 1024**3 / best / 1e9
    load = os.getloadavg()[0]
    return (f"load average {load:.2f}; 1-thread matmul {gflops:.0f} GFLOP/s "
            f"({gflops / IDLE_GFLOPS:.0%} of the idle machine's {IDLE_GFLOPS:.0f})")
