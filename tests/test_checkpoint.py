"""Checkpoints reshard without loss: packed weights keep the module's own order at every tp.

A packed weight (Phi-3's fused ``gate_up_proj`` and GPT-2's Conv1D ``c_attn``: ``packed_colwise``; Mixtral's expert bank
``gate_up_proj`` [E, 2I, H]: ``moe_tp_experts``) keeps [gate_r; up_r] on rank r. Its DTensor
placement says so (``_StridedShard``, see ``shardplan.apply.styles.packed_placement``), so
the global view a checkpoint stores is [gate; up] whatever tp is. Before, it was
``Shard(0)`` of the local blocks, a global order [g0, u0, g1, u1] that depends on tp: a DCP
checkpoint saved at tp=2 and loaded at tp=4 put wrong rows in gate_up_proj (logits off by
0.34 on tiny Phi-3), with no error.

One launch saves at tp=2 (one AdamW step first, so the optimizer has moments), one loads at
tp=4. Checked, every tensor exactly (a load only moves bytes):

* the tp=4 model's and optimizer's gathered state equal what tp=2 saved;
* an unsharded model (one process, no process group) loading the same DCP checkpoint gets
  the same tensors, and its logits equal the tp=4 model's (float tolerance: other reduction
  order) and the tp=2 model's;
* ``shardplan.full_state_dict`` equals DCP's own full state dict and loads into the plain
  model with ``load_state_dict``; ``shardplan.load_full_state_dict`` at tp=4 rebuilds the
  same state.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")

import shardplan  # noqa: E402
from shardplan.tools.launch import run_on_gloo  # noqa: E402
from tests import _checkpoint_workers as w  # noqa: E402
from tests._checks import flat_state

TYPES = ["phi3", "mixtral", "qwen3_moe", "gpt2"]


# the style each type tests, at each tp; qwen3_moe's 2 kv heads are gathered on 2 ranks each at tp=4;
# mixtral saved with whole experts per rank at tp=2 loads split inside every expert at tp=4
PACKED = {("phi3", 2): "packed_colwise", ("phi3", 4): "packed_colwise", ("mixtral", 2): "moe_whole_experts",
          ("mixtral", 4): "moe_tp_experts", ("qwen3_moe", 4): "colwise_kv_gathered",
          # GPT-2's fused c_attn is HF's Conv1D ([in, out]): packed along weight dim 1
          ("gpt2", 2): "packed_colwise", ("gpt2", 4): "packed_colwise"}


def _plan(model_type: str, tp: int) -> str:
    model, ids = w.build(model_type, 0)
    style = PACKED.get((model_type, tp), "")
    pins = {"model.layers.*.mlp.experts": style} if style.startswith("moe_") else {}
    plan = shardplan.price_styles(model, {"tp": tp}, pins, example_inputs=(ids,))
    if (model_type, tp) in PACKED:
        assert PACKED[model_type, tp] in set(plan.module_styles().values()), plan.module_styles()
    return plan.to_yaml()


def _assert_equal(got: dict, want: dict, what: str) -> None:
    got, want = flat_state(got), flat_state(want)
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}"


def _unsharded(model_type: str, folder: str) -> tuple[dict, dict, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    import torch.distributed.checkpoint as dcp

    model, ids = w.build(model_type, 3)
    opt = w.one_step(model, ids)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)  # no process group: DCP reads in this one process
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    with torch.no_grad():
        logits = model(ids).logits
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, get_optimizer_state_dict(model, opt), logits


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model_type", TYPES)
def test_dcp_save_tp2_load_tp4_and_unsharded(model_type: str, tmp_path) -> None:
    folder = str(tmp_path / "ckpt")
    saved = run_on_gloo(w.train_and_save, world_size=2, args=(model_type, _plan(model_type, 2), folder), timeout_s=240)[0]
    _assert_equal(saved["model"], saved["dcp_full_model"], "shardplan.full_state_dict vs DCP's full state dict")
    loaded = run_on_gloo(w.load_and_report, world_size=4, timeout_s=240,
                         args=(model_type, _plan(model_type, 4), folder, saved["model"]))[0]
    _assert_equal(loaded["model"], saved["model"], "model state at tp=4 vs saved at tp=2")
    _assert_equal(loaded["optim"], saved["optim"], "optimizer state at tp=4 vs saved at tp=2")
    _assert_equal(loaded["from_full"], saved["model"], "load_full_state_dict at tp=4")
    model, optim, logits = _unsharded(model_type, folder)
    _assert_equal(model, saved["model"], "unsharded load of the tp=2 checkpoint")
    _assert_equal(optim, saved["optim"], "unsharded optimizer state")
    for name, got in (("tp=4", loaded["logits"]), ("tp=2", saved["logits"]), ("full dict at tp=4", loaded["from_full_logits"])):
        torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"logits {n} vs unsharded: {m}")


def test_full_state_dict_loads_into_the_plain_model() -> None:
    """In one process on the fake group nothing is gathered for real, so check the keys and
    global shapes only: the same as the unsharded model's state_dict."""
    from shardplan.apply.mesh import fake_process_group, make_mesh

    plain, ids = w.build("phi3", 0)
    model, _ = w.build("phi3", 0)
    plan = shardplan.Plan.from_yaml(_plan("phi3", 4))
    with fake_process_group(4):
        shardplan.apply_plan(model, make_mesh({"tp": 4}), plan)
        sd = shardplan.full_state_dict(model)
    want = plain.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in want.items()}
    assert all(not isinstance(v, torch.distributed.tensor.DTensor) for v in sd.values())


def test_load_full_state_dict_says_what_is_wrong() -> None:
    model, _ = w.build("phi3", 0)
    sd = model.state_dict()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\].*strict=False"):
        shardplan.load_full_state_dict(model, {k: v for k, v in sd.items() if k != "lm_head.weight"})
    key = "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=r"has shape \(3,\); the model's is"):
        shardplan.load_full_state_dict(model, {**sd, key: torch.zeros(3)})


def test_planning_first_leaves_no_stale_mesh_behind() -> None:
    """Planning runs a fake group of the same shape (the local check). DTensor caches
    redistribute planners and sharding decisions by mesh value, holding the mesh they were
    made with, so a real mesh made afterwards got some parameters placed on the fake one:
    rank 1's weights then reported rank 0's coordinate, and every slice cut by coordinate
    (load_full_state_dict, DCP offsets, safetensors loading) took rank 0's rows."""
    from shardplan.apply.mesh import fake_process_group, make_mesh

    model, _ = w.build("llama", 0)
    plan = shardplan.Plan.from_yaml(_plan("llama", 2))
    with fake_process_group(2, rank=1):
        mesh = make_mesh({"tp": 2})
        shardplan.apply_plan(model, mesh, plan)
        stale = [n for n, p in model.named_parameters() if p.device_mesh is not mesh or tuple(p.device_mesh.get_coordinate()) != (1,)]
    assert not stale, f"{len(stale)} parameters on another mesh, e.g. {stale[:3]}"
