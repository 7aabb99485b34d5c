"""A fused q/k/v of unequal widths (GQA: ``split([h*hd, kv*hd, kv*hd], -1)``) split by heads.

Rank r holds rows [q_r; k_r; v_r] of ``wqkv`` (``packed_colwise`` with ``packed: [h, kv, kv]``),
placed ``PackedShard(0, parts=[h, kv, kv])`` (:mod:`shardplan.apply.packed`), whose global
view is the module's own [Q; K; V] at every tp. The model and the hand-written plan are in
``tests/_unequal_packed_workers.py``. Checked:

* on the fake group: the placement, the local rows, the DCP chunks (one per part, at the
  part's offset) at tp=2 and tp=4, and the plan file's ``packed`` list (validation, round trip);
* on 2 gloo ranks vs one process: logits, every gradient, every weight and AdamW moment after
  2 steps (foreach and for-loop), all gathered with ``full_tensor``;
* DCP saved at tp=2 loads into the unsharded model (model and optimizer) and back at tp=2;
  ``full_state_dict`` loads into the plain model; ``load_full_state_dict`` and
  ``load_checkpoint`` (a safetensors file of the unsharded model) rebuild it exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.apply.mesh import fake_process_group, make_mesh
from shardplan.apply.packed import PackedShard
from shardplan.apply.state import local_runs
from shardplan.plan.model import PlanFileError
from shardplan.tools.launch import run_on_gloo
from tests import _unequal_packed_workers as w
from tests._checks import flat_state

HD = w.HEAD_DIM


def _apply_fake(tp: int, n_head: int, n_kv: int, rank: int, **kw):
    model = w.build(0, n_head, n_kv)
    plan = shardplan.Plan.from_yaml(w.plan_yaml(tp, n_head, n_kv, **kw))
    shardplan.apply_plan(model, make_mesh({"tp": tp}), plan)
    return model


@pytest.mark.parametrize(("tp", "n_head", "n_kv"), [(2, 8, 2), (4, 8, 4)])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_heads_of_q_k_and_v(tp: int, n_head: int, n_kv: int, rank: int) -> None:
    full = w.build(0, n_head, n_kv).layers[0].attn.wqkv
    q, kv = n_head * HD, n_kv * HD
    with fake_process_group(tp, rank=rank):
        wqkv = _apply_fake(tp, n_head, n_kv, rank).layers[0].attn.wqkv
        for name, want in (("weight", full.weight), ("bias", full.bias)):
            t = getattr(wqkv, name)
            assert isinstance(t, DTensor) and t.placements == (PackedShard(0, parts=[n_head, n_kv, n_kv]),)
            assert isinstance(t.placements[0], PackedShard)
            assert t.shape == want.shape
            starts = [rank * q // tp, q + rank * kv // tp, q + kv + rank * kv // tp]
            sizes = [q // tp, kv // tp, kv // tp]
            if rank == 0:  # the fake group scatters nothing: only rank 0 (the source) has real rows
                rows = torch.cat([want[a:a + n] for a, n in zip(starts, sizes)])
                assert torch.equal(t.to_local(), rows.detach())
            assert local_runs(t)[0] == [(sum(sizes[:i]), a, a + n) for i, (a, n) in enumerate(zip(starts, sizes))]
            # DCP: one chunk per part, at the part's own offset in [Q; K; V]
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()]
            rest = tuple(want.shape[1:])
            assert chunks == [((a,) + (0,) * len(rest), (n,) + rest) for a, n in zip(starts, sizes)]


def test_the_forward_hands_on_the_local_q_k_v() -> None:
    with fake_process_group(2, rank=1):
        model = _apply_fake(2, 8, 2, 1)
        x = torch.randn(2, 5, w.DIM)
        y = model.layers[0].attn.wqkv(x)
        assert not isinstance(y, DTensor) and y.shape == (2, 5, (8 + 2 + 2) * HD // 2)
        assert model(w.tokens()).shape == (2, 12, w.VOCAB)


def test_packed_lists_in_the_plan_file() -> None:
    text = w.plan_yaml(2)
    assert "  packed:\n  - 8\n  - 2\n  - 2\n" in text
    plan = shardplan.Plan.from_yaml(text)
    assert plan.rule_for("layers.0.attn.wqkv").packed == [8, 2, 2]
    assert shardplan.Plan.from_yaml(plan.to_yaml()).to_yaml() == text
    for bad in ("[8]", "[8, 0]", "1", "[8.5, 2, 2]", "true"):
        with pytest.raises(PlanFileError, match="neither a count of equal parts"):
            shardplan.Plan.from_yaml(text.replace("  packed:\n  - 8\n  - 2\n  - 2\n", f"  packed: {bad}\n"))


def test_a_tp_that_does_not_divide_every_part_is_refused() -> None:
    from shardplan.plan.validate import check_findings

    # relative widths ([4, 1, 1]) or rows ([64, 16, 16]) fit; widths that do not sum to a
    # divisor of the rows, or parts tp does not divide, are findings and errors
    model = w.build(0, 8, 2)
    for parts in ([4, 1, 1], [64, 16, 16]):
        assert check_findings(shardplan.Plan.from_yaml(w.plan_yaml(2, 8, 2, parts=parts)), model) == []
    bad = shardplan.Plan.from_yaml(w.plan_yaml(2, 8, 2, parts=[5, 3, 3]))
    (finding,) = [f for f in check_findings(bad, model) if "packed" in f]
    assert "packed [5, 3, 3] does not fit its 96 output features" in finding and "\n" not in finding
    odd = shardplan.Plan.from_yaml(w.plan_yaml(2, 8, 2, parts=[30, 1, 1]))
    (finding,) = [f for f in check_findings(odd, model) if "packed" in f]
    assert "parts of [90, 3, 3] rows, which tp=2 does not divide" in finding
    with fake_process_group(2), pytest.warns(UserWarning, match="tp=2 does not divide"), \
            pytest.raises(ValueError, match=r"packed \[30, 1, 1\] cuts its 96 output features into parts of \[90, 3, 3\]"):
        shardplan.apply_plan(w.build(0, 8, 2), make_mesh({"tp": 2}), odd)


def test_equal_widths_stay_a_strided_shard() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardplan.apply.styles import packed_placement

    for parts in (3, [2, 2, 2]):
        p = packed_placement(parts=parts, dim=0)
        assert type(p) is _StridedShard and p.split_factor == 3
    assert type(packed_placement(parts=[4, 1, 1], dim=0)) is PackedShard


def _no_key_bias(state: dict) -> dict:
    """Softmax ignores a bias of the keys: its gradient is rounding noise (~1e-9), which Adam
    scales to whole steps of either sign, so after a step its rows [Q, Q + K) are left out."""
    keep = torch.cat([torch.arange(0, 8 * HD), torch.arange(10 * HD, 12 * HD)])
    return {k: v[keep] if k.endswith("wqkv.bias") else v for k, v in state.items()}


def _assert_close(got: dict, want: dict, what: str, **tol) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for k in want:
        g, v = got[k], want[k]
        if isinstance(v, dict):
            _assert_close(g, v, f"{what} {k}", **tol)
        else:
            torch.testing.assert_close(g, v, **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


@pytest.mark.parametrize("foreach", [True, False])
def test_training_on_two_gloo_ranks_matches_one_process(foreach: bool) -> None:
    want = w.train(w.build(0), foreach=foreach)
    got = run_on_gloo(w.train_sharded, world_size=2, args=(w.plan_yaml(2), foreach), timeout_s=240)
    for rank, result in enumerate(got):
        assert result["placements"]["layers.0.attn.wqkv.weight"] == ["PackedShard(dim=0, parts=[8, 2, 2])"]
        torch.testing.assert_close(result["logits"], want["logits"], atol=1e-5, rtol=1e-5)
        _assert_close(result["grads"], want["grads"], f"rank {rank} gradient", atol=1e-5, rtol=1e-4)
        _assert_close(_no_key_bias(result["weights"]), _no_key_bias(want["weights"]), f"rank {rank} weight",
                      atol=1e-5, rtol=1e-4)
        _assert_close(result["moments"], want["moments"], f"rank {rank} AdamW state", atol=1e-6, rtol=1e-4)


def _exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_reshard_exactly(tmp_path) -> None:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    folder, file = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    yaml = w.plan_yaml(2)
    saved = run_on_gloo(w.save_sharded, world_size=2, args=(yaml, folder), timeout_s=240)
    # one chunk per part on each rank: [Q; K; V] rows 0-32, 64-72, 80-88 and 32-64, 72-80, 88-96
    assert [r["chunks"]["layers.0.attn.wqkv.weight"] for r in saved] == [
        [((0, 0), (32, 32)), ((64, 0), (8, 32)), ((80, 0), (8, 32))],
        [((32, 0), (32, 32)), ((72, 0), (8, 32)), ((88, 0), (8, 32))]]
    saved = saved[0]

    # the unsharded model (one process, no process group) loads the tp=2 checkpoint
    plain = w.build(5)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    w.loss_of(plain, w.tokens()).backward()
    opt.step()
    state = {"model": plain.state_dict(), "optim": get_optimizer_state_dict(plain, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(plain, opt, state["optim"])
    _exact(plain.state_dict(), saved["model"], "unsharded DCP load vs the tp=2 model")
    _exact(flat_state(get_optimizer_state_dict(plain, opt)), flat_state(saved["optim"]), "unsharded optimizer state")

    # the same one step in one process gives the same weights: the checkpoint is [Q; K; V]
    ref = w.build(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    w.loss_of(ref, w.tokens()).backward()
    ref_opt.step()
    _assert_close(_no_key_bias(saved["model"]), _no_key_bias(ref.state_dict()), "tp=2 step vs one process",
                  atol=1e-5, rtol=1e-4)

    # full_state_dict (tp=2 -> tp=1) loads into the plain model as it is
    one = w.build(6)
    one.load_state_dict(saved["model"])
    _exact(one.state_dict(), saved["model"], "full_state_dict into the plain model")

    # back at tp=2: DCP, load_full_state_dict and load_checkpoint of a safetensors file
    safetensors.torch.save_file({k: v.contiguous() for k, v in saved["model"].items()}, file)
    loaded = run_on_gloo(w.load_sharded, world_size=2, args=(yaml, folder, saved["model"], file), timeout_s=240)[0]
    _exact(loaded["dcp"], saved["model"], "DCP load at tp=2")
    _exact(flat_state(loaded["dcp_optim"]), flat_state(saved["optim"]), "optimizer state loaded at tp=2")
    _exact(loaded["from_full"], saved["model"], "load_full_state_dict at tp=2")
    _exact(loaded["from_file"], saved["model"], "load_checkpoint at tp=2")
    with torch.no_grad():
        torch.testing.assert_close(loaded["logits"], one(w.tokens()), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tp2_checkpoint_loads_at_tp4(tmp_path) -> None:
    """8 query heads beside 4 kv heads ([2, 1, 1]): saved at tp=2, each of 4 ranks reads its
    own rows of every part back (DCP, model and AdamW state; load_checkpoint of the file)."""
    import safetensors.torch

    folder, file = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    saved = run_on_gloo(w.save_sharded, world_size=2, args=(w.plan_yaml(2, n_kv=4), folder, 4), timeout_s=240)[0]
    safetensors.torch.save_file({k: v.contiguous() for k, v in saved["model"].items()}, file)
    loaded = run_on_gloo(w.load_sharded, world_size=4, args=(w.plan_yaml(4, n_kv=4), folder, saved["model"], file, 4),
                         timeout_s=240)
    for rank, got in enumerate(loaded):
        _exact(got["dcp"], saved["model"], f"rank {rank}: DCP load at tp=4")
        _exact(got["from_file"], saved["model"], f"rank {rank}: load_checkpoint at tp=4")
    # the full optimizer state is gathered to rank 0 (cpu_offload)
    _exact(flat_state(loaded[0]["dcp_optim"]), flat_state(saved["optim"]), "optimizer state at tp=4")
