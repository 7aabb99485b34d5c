"""Spawn-importable workers for ``tests/test_gradsync.py`` (real gloo ranks).

``accumulate(rank, world_size, plan_yaml, micro_counts, dp)`` builds llama3-debug twice
from one seed: a reference in this process, unsharded, and a copy sharded by the plan
(on a ``(dp, tp)`` mesh; with ``dp > 1`` every block and the root are also wrapped with
``fully_shard`` on the ``dp`` axis). For each micro-batch count it runs one optimizer step's
worth of micro-batches on the sharded copy (``set_requires_gradient_sync(model, i == last)``)
and one backward of the whole batch on the reference, and returns the worst gradient
difference, the placements the norm gradients end with and the collectives CommDebugMode
counted per phase. Imports no pytest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import shardplan
from shardplan.apply.gradsync import set_requires_gradient_sync
from shardplan.models.presets import build_preset, get_preset

NAME = "llama3-debug"
MICRO_ROWS = 2  # sequences per micro-batch per data-parallel rank


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k).rsplit(".", 1)[-1]: v for k, v in mode.get_comm_counts().items()}


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def _sharded(plan: shardplan.Plan, mesh, dp: int) -> torch.nn.Module:
    model = build_preset(NAME, device="cpu", seed=0)
    shardplan.apply_plan(model, mesh, plan)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _one_step(model, tokens, targets, *, micro: int, dp_rank: int) -> dict[str, Any]:
    """``micro`` micro-batches of this dp rank's rows, gradients accumulated; counts per phase."""
    phases: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    rows = MICRO_ROWS
    for i in range(micro):
        set_requires_gradient_sync(model, i == micro - 1)
        start = (dp_rank * micro + i) * rows
        x, y = tokens[start:start + rows], targets[start:start + rows]
        with CommDebugMode() as mode:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / micro
        _add(phases["forward"], _counts(mode))
        with CommDebugMode() as mode:
            loss.backward()
        _add(phases["backward"], _counts(mode))
    return phases


def accumulate(rank: int, world_size: int, plan_yaml: str, micro_counts: list[int], dp: int) -> dict[int, Any]:
    tp = world_size // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = shardplan.Plan.from_yaml(plan_yaml)
    out: dict[int, Any] = {}
    for micro in micro_counts:
        ref, model = build_preset(NAME, device="cpu", seed=0), _sharded(plan, mesh, dp)
        (tokens,) = get_preset(NAME).example_inputs(batch_size=dp * micro * MICRO_ROWS, device="cpu")
        targets = torch.randint(0, get_preset(NAME).config.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(7))
        # the reference: the whole global batch in one backward (its mean is the mean of the
        # micro-batch means, averaged over dp by FSDP's reduce-scatter)
        F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten()).backward()
        phases = _one_step(model, tokens, targets, micro=micro, dp_rank=mesh["dp"].get_local_rank())
        params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
        norm_placements = {n: [str(p) for p in params[n].grad.placements] for n in params if "norm" in n}
        diff = max(float((_full(params[n].grad) - ref_params[n].grad).abs().max()) for n in ref_params)
        with CommDebugMode() as mode:
            torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        phases["optimizer"] = _counts(mode)
        out[micro] = {"grad_max_diff": diff, "norm_placements": norm_placements, "phases": phases}
    return out
