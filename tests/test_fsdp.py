"""FSDP2 on the data axes: ``fully_shard_plan`` after ``apply_plan``, and its priced collectives.

* gloo: 4 ranks, a ``(dp=2, tp=2)`` mesh, ``llama3-debug`` in float32: two AdamW steps with
  ``clip_grad_norm_`` on a global batch split over dp equal one process on the whole batch.
* fake group: the units, their order and ``reshard_after_forward``, tied weights, HSDP, the
  errors, and the estimate's ``data_parallel`` collectives against what FSDP2 issues
  (``simulate(..., fsdp=True)`` counts its c10d ops) for a whole forward + backward.
"""

from __future__ import annotations

import warnings

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardplan
from shardplan.apply.fsdp import FSDPOptions, fsdp_units, fully_shard_plan
from shardplan.apply.mesh import fake_process_group, make_mesh
from shardplan.decide import cost
from shardplan.decide import fsdp as decide_fsdp
from shardplan.models.presets import build_preset, get_preset
from shardplan.tools.launch import run_on_gloo
from shardplan.tools.simulate import simulate
from tests import _fsdp_workers as workers
from tests.test_numerics import TOLS

NAME = "llama3-debug"


def _plan(axes: dict[str, int], **opts) -> shardplan.Plan:
    model = build_preset(NAME, device="meta")
    return shardplan.plan_model(model, axes, example_inputs=get_preset(NAME).example_inputs(device="meta"),
                                explain=False, **opts)


def _applied(axes: dict[str, int], plan: shardplan.Plan):
    """A meta llama3-debug with ``plan`` applied on a fake mesh of ``axes`` (inside the caller's
    group; plan before entering it, since planning makes its own)."""
    model = build_preset(NAME, device="meta")
    mesh = make_mesh(axes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shardplan.apply_plan(model, mesh, plan)
    return model, mesh, plan


# --------------------------------------------------------------------------- gloo


def test_tp_fsdp_training_matches_one_process() -> None:
    axes = {"dp": 2, "tp": 2}
    plan = _plan(axes)  # per dp rank: batch 2 of the global 4
    atol, rtol = TOLS["param"]
    [res, *others] = run_on_gloo(workers.train, world_size=4, timeout_s=300,
                                 args=(plan.to_yaml(), axes, 4, 2, 1.0, atol, rtol))
    for r in [res, *others]:
        for ref_loss, loss in r["losses"]:
            assert abs(loss - ref_loss) <= TOLS["loss"][0], r["losses"]
        assert r["worst_ratio"][1] <= 1.0, (r["worst_param"], r["worst_ratio"])
        # every weight is a DTensor on the (dp, tp) mesh, FSDP's Shard(0) on dp first
        assert all(ndim == 2 and first_is_dim0_shard for ndim, first_is_dim0_shard in r["placements"]), r["placements"]
    assert res["norms"][0][0] > 1.0  # clip_grad_norm_ did clip, so the norm over shards is exercised
    for ref_norm, norm in res["norms"]:
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm, res["norms"]
    print(f"\nlosses (ref, fsdp+tp): {res['losses']}\nnorms: {res['norms']}\n"
          f"worst final weight |diff| {res['worst_param']}, vs tolerance {res['worst_ratio']}")


# --------------------------------------------------------------------------- units


def test_units_are_the_blocks_then_the_root() -> None:
    model = build_preset(NAME, device="meta")
    plan = _plan({"dp": 2, "tp": 2})
    # torchtitan's default: every block resharded but the one backward starts with; the root never
    assert fsdp_units(plan, model) == [("layers.0", True), ("layers.1", False), ("", False)]
    assert fsdp_units(plan, model, reshard_after_forward="always") == [("layers.0", True), ("layers.1", True), ("", False)]
    assert fsdp_units(plan, model, reshard_after_forward="never") == [("layers.0", False), ("layers.1", False), ("", False)]
    with pytest.raises(ValueError, match="expected one of default, always, never"):
        fsdp_units(plan, model, reshard_after_forward="sometimes")


def test_fully_shard_plan_wraps_each_unit_with_its_own_parameters() -> None:
    plan = _plan({"dp": 2, "tp": 2})
    with fake_process_group(4):
        model, mesh, plan = _applied({"dp": 2, "tp": 2}, plan)
        fully_shard_plan(model, mesh, plan)
        for path, reshard in fsdp_units(plan, model):
            module = model.get_submodule(path)
            assert isinstance(module, FSDPModule), path
            group = fully_shard.state(module)._fsdp_param_group
            names = {n for n, _ in module.named_parameters()}
            if path:  # a block's group holds exactly its parameters: wrapped before the root
                assert len(group.fsdp_params) == len(names), path
                assert (group.post_forward_mesh_info is not None) == reshard, path
            else:
                assert len(group.fsdp_params) == 3  # tok_embeddings, norm, output
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), name
            assert getattr(p.placements[0], "dim", None) == 0, name  # Shard(0), or _StridedShard where tp splits dim 0 too


def test_hsdp_on_a_replicate_shard_pair() -> None:
    axes = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    plan = _plan(axes)
    with fake_process_group(8):
        model, mesh, plan = _applied(axes, plan)
        fully_shard_plan(model, mesh, plan)
        p = model.layers[0].attention.wq.weight
        assert p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        # HSDP: replicated on the outer axis, dim 0 sharded on the inner (strided: tp splits dim 0 too)
        assert p.placements[0] == Replicate() and getattr(p.placements[1], "dim", None) == 0 and p.placements[2] == Shard(0)


def test_a_block_tied_outside_stays_in_the_root() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(8, 8, bias=False)
            self.head.weight = self.layers[3].proj.weight  # tied to a module outside its block
            self.layers[2].proj.weight = self.layers[1].proj.weight  # tied across two blocks

    units = decide_fsdp.fsdp_units({"layers": 4}, Net())
    assert units == [("layers.0", False), ("", False)]  # the last block wrapped is not resharded


# --------------------------------------------------------------------------- errors


def test_errors_say_what_was_given_and_what_to_do() -> None:
    tp4, plan = _plan({"tp": 4}), _plan({"dp": 2, "tp": 2})
    with fake_process_group(4):
        model, mesh, _ = _applied({"tp": 4}, tp4)
        with pytest.raises(ValueError, match="no data axis besides 'tp'"):
            fully_shard_plan(model, mesh, tp4)
    with fake_process_group(4):
        model, mesh, plan = _applied({"dp": 2, "tp": 2}, plan)
        with pytest.raises(ValueError, match=r"names \['dq'\], which the mesh \('dp', 'tp'\) lacks; use some of \['dp'\]"):
            fully_shard_plan(model, mesh, plan, options=FSDPOptions(axes=("dq",)))
        with pytest.raises(ValueError, match="includes the tp axis"):
            fully_shard_plan(model, mesh, plan, options=FSDPOptions(axes=("dp", "tp")))
        with pytest.raises(ValueError, match="sharded over 2 ranks .* the plan given is for tp=4"):
            fully_shard_plan(model, mesh, tp4)
        plain = build_preset(NAME, device="meta")
        with pytest.raises(ValueError, match=r"not sharded on the tp axis yet .* call shardplan.apply_plan"):
            fully_shard_plan(plain, mesh, plan)
        fully_shard_plan(model, mesh, plan)
        with pytest.raises(ValueError, match="already has fully_shard applied"):
            fully_shard_plan(model, mesh, plan)


# --------------------------------------------------------------------------- pricing


@pytest.mark.parametrize("axes", [{"dp": 2, "tp": 2}, {"dp": 4, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}],
                         ids=["dp2-tp2", "dp4-tp2", "hsdp2x2-tp2"])
def test_predicted_equals_counted_for_a_whole_step(axes: dict[str, int]) -> None:
    plan = _plan(axes)
    assert "data_parallel" in plan.estimate.collectives
    result = simulate(build_preset(NAME, device="meta"), plan, get_preset(NAME).example_inputs(device="meta"), fsdp=True)
    for phase in ("forward", "backward", "data_parallel"):
        want = {k: v for k, v in plan.estimate.collectives[phase].model_dump().items() if v}
        assert dict(result.counted[phase]) == want, phase
        assert result.counted_bytes[phase] == plan.estimate.collective_bytes[phase], phase
    assert result.matches
    # 2 blocks + the root: 3 all-gathers forward, 1 backward (the last block and the root stay
    # gathered), 3 reduce-scatters; HSDP all-reduces each reduce-scattered shard once more
    hsdp = "dp_replicate" in axes
    assert dict(result.counted["data_parallel"]) == {"all_gather": 4, "reduce_scatter": 3, **({"all_reduce": 3} if hsdp else {})}


def test_without_fsdp_simulate_leaves_the_data_axes_out() -> None:
    plan = _plan({"dp": 2, "tp": 2})
    result = simulate(build_preset(NAME, device="meta"), plan, get_preset(NAME).example_inputs(device="meta"))
    assert "data_parallel" not in result.predicted and result.matches


def _priced(axes: dict[str, int], **opts) -> shardplan.Plan:
    return _plan(axes, hardware="h100-ib", **opts)  # 8 GPUs a node: dp=16 x tp=8 crosses nodes


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_step_time_includes_the_data_axes_at_their_link(mode: str) -> None:
    tp_only, both = _priced({"tp": 2}), _priced({"dp": 16, "tp": 2}, data_parallel=mode)
    e, base = both.estimate, tp_only.estimate
    assert e.collectives["forward"] == base.collectives["forward"]
    assert e.collectives["backward"] == base.collectives["backward"]
    if mode == "ddp":
        assert e.compute_time_s == pytest.approx(base.compute_time_s, rel=1e-5)
    else:  # each rank's optimizer updates only its 1/dp of the parameters
        assert e.compute_time_s < base.compute_time_s
    link = cost.axis_links(cost.get_hardware("h100-ib"), {"dp": 16, "tp": 2})["dp"]
    assert link == cost.get_hardware("h100-ib").inter_link  # 32 ranks span 4 nodes
    c, n, p = e.collectives["data_parallel"], e.collective_bytes["data_parallel"], 16
    # ring alpha-beta over the counted collectives: every one on the dp link over 16 ranks;
    # DDP's one all-reduce carries every gradient: the tp-local parameter bytes
    if mode == "ddp":
        assert (c.all_reduce, c.all_gather, c.reduce_scatter) == (1, 0, 0)
        assert n == pytest.approx(e.param_bytes_per_device)
        expected = 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * n / link.bandwidth
    else:
        assert c.all_reduce == 0
        expected = (c.all_gather + c.reduce_scatter) * (p - 1) * link.alpha_s + (p - 1) / p * n / link.bandwidth
    assert e.comm_time_s - base.comm_time_s == pytest.approx(expected, rel=1e-4)
    assert e.step_time_s == pytest.approx(e.compute_time_s + e.comm_time_s, rel=1e-5)


def test_apply_plan_and_auto_parallelize_take_fsdp() -> None:
    """``fsdp=`` on the public calls: TP, then the same units as ``fully_shard_plan``; options
    pass through; anything but a bool or FSDPOptions is refused before anything is sharded."""
    plan = _plan({"dp": 2, "tp": 2})
    with fake_process_group(4):
        mesh = make_mesh({"dp": 2, "tp": 2})
        model = build_preset(NAME, device="meta")
        with pytest.raises(ValueError, match="fsdp must be True, False or a shardplan.apply.fsdp.FSDPOptions; got str"):
            shardplan.apply_plan(model, mesh, plan, fsdp="yes")
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shardplan.apply_plan(model, mesh, plan, fsdp=True)
        assert [p for p, _ in fsdp_units(plan, model)] == [f for f, m in model.named_modules() if isinstance(m, FSDPModule)][1:] + [""]
        other = build_preset(NAME, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shardplan.auto_parallelize(other, mesh, example_inputs=get_preset(NAME).example_inputs(device="meta"),
                                       explain=False, fsdp=FSDPOptions(reshard_after_forward="never"))
        blocks = [m for f, m in other.named_modules() if f and isinstance(m, FSDPModule)]
        assert blocks and all(fully_shard.state(m)._fsdp_param_group.post_forward_mesh_info is None for m in blocks)
