"""Spawn-importable worker for ``tests/test_compile.py`` (real gloo ranks).

``compare(rank, world_size, plans, modes, backend)``: for each plan (YAML text, keyed by a
name) and each mode (``"blocks"``: ``shardplan.apply.compile.compile_blocks``; ``"whole"``:
``model.compile()``), it shards two llama3-debug builds of one seed, compiles one, runs
forward, a cross-entropy loss and backward on both, and returns the worst difference of
the logits and of every gradient (``full_tensor()``), compiled vs eager. Imports no pytest.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.apply.compile import compile_blocks
from shardplan.models.presets import build_preset, get_preset

NAME = "llama3-debug"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return _full(logits).detach(), {n: _full(p.grad) for n, p in model.named_parameters()}


def _case(plan: shardplan.Plan, mesh, mode: str, backend: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    eager, compiled = (shardplan.apply_plan(build_preset(NAME, device="cpu", seed=0), mesh, plan) for _ in range(2))
    if mode == "blocks":
        compile_blocks(compiled, plan, backend=backend)
    else:
        compiled.compile(backend=backend)
    (x,) = get_preset(NAME).example_inputs(device="cpu")
    y = torch.randint(0, get_preset(NAME).config.vocab_size, x.shape, generator=torch.Generator().manual_seed(7))
    want_logits, want_grads = _run(eager, x, y)
    graphs = counters["stats"]["unique_graphs"]
    got_logits, got_grads = _run(compiled, x, y)
    partial = [n for n, p in compiled.named_parameters() if any(pl.is_partial() for pl in p.grad.placements)]
    grad_diff = {n: float((got_grads[n] - want_grads[n]).abs().max()) for n in want_grads}
    worst = max(grad_diff, key=grad_diff.get)
    return {
        "logits_max_diff": float((got_logits - want_logits).abs().max()),
        "grad_max_diff": grad_diff[worst], "worst_grad": worst,
        "grad_scale": max(float(g.abs().max()) for g in want_grads.values()),
        "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
        "graph_breaks": sum(counters["graph_break"].values()), "partial_grads": partial,
        "seconds": time.perf_counter() - t0,
    }


def compare(rank: int, world_size: int, plans: dict[str, str], modes: list[str], backend: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for key, text in plans.items():
        plan = shardplan.Plan.from_yaml(text)
        for mode in modes:
            out[f"{key}-{mode}"] = _case(plan, mesh, mode, backend)  # a raise ends every rank (run_on_gloo)
    return out
