"""Sequence-parallel norms' Partial gradients: one bucketed all-reduce per optimizer step.

Fake-group tests count a whole training step of llama3-debug (forward, backward,
``clip_grad_norm_``, AdamW) with ``CommDebugMode`` and record the bucket's size with a
dispatch mode; gloo tests compare accumulated gradients with one process (tp=2, and
dp=2 x tp=2 under ``fully_shard``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import shardplan
from shardplan.apply.gradsync import reduce_partial_gradients, set_requires_gradient_sync
from shardplan.apply.mesh import fake_process_group, make_mesh
from shardplan.models.presets import build_preset, get_preset
from shardplan.tools.launch import run_on_gloo
from tests import _gradsync_workers as workers

NAME = "llama3-debug"
# 1e-8 measured (float32, tp=2 and dp=2 x tp=2), as test_numerics' gradient tolerance
GRAD_ATOL = 2e-6


def _plan(axes: dict[str, int]) -> shardplan.Plan:
    model = build_preset(NAME, device="meta")
    return shardplan.plan_model(model, axes, example_inputs=get_preset(NAME).example_inputs(device="meta"),
                                explain=False, sequence_parallel=True)


def _norm_weights(model: torch.nn.Module, plan: shardplan.Plan) -> dict[str, torch.nn.Parameter]:
    """The parameters of the modules the plan styles ``sequence_parallel``: the ones whose
    gradients are Partial (each rank sees 1/tp of the tokens)."""
    sp = [m for m, s in plan.module_styles().items() if s in ("sequence_parallel", "replicated_with_grad_allreduce")]
    return {f"{m}.{n}": p for m in sp for n, p in model.get_submodule(m).named_parameters(recurse=False)}


def _materialized(plan: shardplan.Plan, mesh) -> torch.nn.Module:
    """Built on meta, sharded, then given storage with to_empty (which replaces every parameter)."""
    model = build_preset(NAME, device="meta")
    shardplan.apply_plan(model, mesh, plan)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p.to_local() if isinstance(p, DTensor) else p, std=0.02)
    return model


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k).rsplit(".", 1)[-1]: v for k, v in mode.get_comm_counts().items()}


class _AllReduceSizes(TorchDispatchMode):
    """Records the element count of every functional all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whole_step_has_one_bucketed_all_reduce_and_none_in_the_optimizer(tp):
    plan = _plan({"tp": tp})
    (x,) = get_preset(NAME).example_inputs(device="cpu")
    with fake_process_group(tp):
        model = _materialized(plan, make_mesh({"tp": tp}))
        norms = _norm_weights(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counts = {}
        with CommDebugMode() as mode:
            loss = _loss(model, x)
        counts["forward"] = _counts(mode)
        with CommDebugMode() as mode, _AllReduceSizes() as sizes:
            loss.backward()
        counts["backward"] = _counts(mode)
        placements = {n: p.grad.placements for n, p in norms.items()}
        with CommDebugMode() as mode:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        counts["clip"] = _counts(mode)
        with CommDebugMode() as mode:
            opt.step()
        counts["optimizer"] = _counts(mode)
    assert len(norms) == 5  # 2 blocks x (attention_norm, ffn_norm) + the final norm
    assert all(not pl[0].is_partial() for pl in placements.values()), placements
    # the activations move by all-gather/reduce-scatter under SP; the only all-reduce of the
    # backward is the bucket, which holds every norm weight once
    assert counts["backward"]["all_reduce"] == 1, counts
    assert sizes.sizes == [sum(p.to_local().numel() for p in norms.values())]
    assert "all_reduce" not in counts["forward"], counts
    assert counts["clip"] == {"all_reduce": 1}, counts  # the global norm of sharded gradients
    assert counts["optimizer"] == {}, counts  # every gradient is placed like its parameter


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulation_reduces_once_per_optimizer_step(micro):
    plan = _plan({"tp": 2})
    (x,) = get_preset(NAME).example_inputs(device="cpu")
    backward: dict[str, int] = {}
    with fake_process_group(2):
        model = _materialized(plan, make_mesh({"tp": 2}))
        norms = _norm_weights(model, plan)
        still_partial = []
        for i in range(micro):
            set_requires_gradient_sync(model, i == micro - 1)
            loss = _loss(model, x) / micro
            with CommDebugMode() as mode:
                loss.backward()
            for k, v in _counts(mode).items():
                backward[k] = backward.get(k, 0) + v
            still_partial.append(all(p.grad.placements[0].is_partial() for p in norms.values()))
    assert backward["all_reduce"] == 1, backward
    # the activations' collectives are per micro-batch (5 all-gathers, 5 reduce-scatters each)
    assert backward["all_gather_into_tensor"] == backward["reduce_scatter_tensor"] == 5 * micro, backward
    assert still_partial == [True] * (micro - 1) + [False]


def test_the_reduction_finds_parameters_by_name_after_to():
    """``.to`` swaps the parameters again (after to_empty); the bucket follows the new ones."""
    plan = _plan({"tp": 2})
    (x,) = get_preset(NAME).example_inputs(device="cpu")
    with fake_process_group(2):
        model = _materialized(plan, make_mesh({"tp": 2})).to(torch.float64)
        with CommDebugMode() as mode, _AllReduceSizes() as sizes:
            model(x).sum().backward()
        grads = {n: p.grad for n, p in _norm_weights(model, plan).items()}
        assert reduce_partial_gradients(model) == 0  # nothing is left Partial
    assert _counts(mode)["all_reduce"] == 1 and sizes.sizes == [5 * 64]
    assert all(g.dtype == torch.float64 and g.placements[0].is_replicate() for g in grads.values()), grads


def test_one_call_switches_fsdp_too_and_fsdp_reduces_partial_gradients_itself():
    """Measured: after fully_shard, FSDP2 redistributes each Partial gradient to its
    parameter's tp placement in its post-backward (one all-reduce per norm weight, at the
    final micro-batch only), so the bucket finds nothing Partial."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    plan = _plan({"dp": 2, "tp": 2})
    (x,) = get_preset(NAME).example_inputs(device="cpu")
    with fake_process_group(4):
        mesh = make_mesh({"dp": 2, "tp": 2})
        model = build_preset(NAME, device="meta")
        shardplan.apply_plan(model, mesh, plan)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        counts = []
        for sync in (False, True):
            set_requires_gradient_sync(model, sync)
            groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
            assert groups and all(g.reduce_grads is sync for g in groups)
            with CommDebugMode() as mode:
                _loss(model, x).backward()
            counts.append(_counts(mode))
        placements = {n: p.grad.placements for n, p in _norm_weights(model, plan).items()}
    assert "all_reduce" not in counts[0] and "_reduce_scatter_base_" not in counts[0], counts[0]
    assert counts[1]["all_reduce"] == len(placements) == 5, counts[1]
    assert all(str(pl) == "(Shard(dim=0), Replicate())" for pl in placements.values()), placements


def test_the_switch_refuses_what_it_cannot_switch():
    with pytest.raises(ValueError, match="True or False"):
        set_requires_gradient_sync(torch.nn.Linear(2, 2), 0)
    with pytest.raises(ValueError, match="neither sharded by shardplan.apply_plan nor wrapped by fully_shard"):
        set_requires_gradient_sync(torch.nn.Linear(2, 2), False)
    with pytest.raises(ValueError, match="no shardplan gradient sync"):
        reduce_partial_gradients(torch.nn.Linear(2, 2))


def test_accumulated_gradients_match_one_process():
    plan = _plan({"tp": 2})
    res = run_on_gloo(workers.accumulate, world_size=2, args=(plan.to_yaml(), [1, 2, 4], 1), timeout_s=240)
    for rank, per in enumerate(res):
        for micro, r in per.items():
            where = f"rank {rank}, {micro} micro-batches"
            assert r["grad_max_diff"] <= GRAD_ATOL, (where, r["grad_max_diff"])
            assert set(map(tuple, r["norm_placements"].values())) == {("R",)}, (where, r["norm_placements"])
            assert r["phases"]["backward"]["all_reduce"] == 1, (where, r["phases"])
            assert r["phases"]["optimizer"] == {}, (where, r["phases"])


def test_fsdp_and_tp_accumulated_gradients_match_one_process():
    plan = _plan({"dp": 2, "tp": 2})
    res = run_on_gloo(workers.accumulate, world_size=4, args=(plan.to_yaml(), [2], 2), timeout_s=240)
    for rank, per in enumerate(res):
        r = per[2]
        assert r["grad_max_diff"] <= GRAD_ATOL, (rank, r["grad_max_diff"])
        assert set(map(tuple, r["norm_placements"].values())) == {("S(0)", "R")}, (rank, r["norm_placements"])
        assert r["phases"]["backward"]["all_reduce"] == 5, (rank, r["phases"])  # FSDP's own, once per step
        assert r["phases"]["optimizer"] == {}, (rank, r["phases"])
