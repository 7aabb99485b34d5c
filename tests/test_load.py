"""Big models load without being materialized whole: ``shardplan.materialize`` and
``shardplan.load_checkpoint``.

On 2 gloo ranks a tiny model is built on the meta device, sharded with a tp=2 plan,
materialized and loaded from a safetensors checkpoint: Hugging Face Llama with tied
embeddings (no ``lm_head.weight`` in the file), Hugging Face Phi-3, whose fused
``gate_up_proj`` is a packed ``_StridedShard`` weight (both saved with
``save_pretrained``, once whole and once sharded with an index), and shardplan's own
``llama3-debug`` (torchtitan-style ``init_weights``, RoPE tables in non-persistent
buffers) planned with sequence parallel, so the norms' Partial gradients go through the
gradient-sync hooks. Checked against one process:

* ``materialize(seed=0)`` gives every rank its shard of exactly the tensors one process
  gets from ``to_empty`` + ``torch.manual_seed(0)`` + ``init_weights()`` (the model's own
  code, no shardplan in the reference), and ``init=`` a function that touches every
  parameter directly is exact too; the forward/backward after it matches that process;
* ``load_checkpoint`` from every checkpoint gives every parameter
  exactly the file's values, and logits equal to the saved model's within 1e-5;
* each rank reads, through ``get_slice`` only, half the bytes of every sharded tensor
  (the two ranks' halves add up to the tensor) and all of every replicated one;
* unseeded ranks with different generator states are refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import shardplan  # noqa: E402
from shardplan.tools.launch import run_on_gloo  # noqa: E402
from tests import _load_workers as w  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def _ids(model: torch.nn.Module) -> torch.Tensor:
    vocab = getattr(model.config, "vocab_size", None)
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


def _plan(model_type: str, ids: torch.Tensor) -> str:
    model = w.build(model_type, "meta")
    options = {"sequence_parallel": True} if model_type == "llama3-debug" else {}
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(ids.to("meta"),), **options)
    styles = set(plan.module_styles().values())
    want = {"llama-tied": "embedding_rowwise", "phi3": "packed_colwise", "llama3-debug": "sequence_parallel"}
    assert want[model_type] in styles, styles
    return plan.to_yaml()


def _one_process(model_type: str, init=None) -> torch.nn.Module:
    """What one process gets: the unsharded model, from the same seed, by the model's own code."""
    model = w.build(model_type, "meta")
    model.to_empty(device="cpu")  # this unties tied weights: a new tensor per owner
    if init is not None and hasattr(model, "tie_weights"):
        model.tie_weights()  # a user's init= sees the model tied (init_weights re-ties after its init)
    torch.manual_seed(0 if init is None else 5)
    with torch.no_grad():
        (init or (lambda m: m.init_weights()))(model)
    if init is not None and hasattr(model, "_init_weights"):
        model._init_weights(model.model.rotary_emb)  # transformers' rebuild of the rope table
    return model


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}"


def _checkpoints(model_type: str, tmp_path) -> tuple[torch.nn.Module, dict[str, str]]:
    saved = w.build(model_type, "cpu", seed=1)  # another seed than the init: loads must overwrite it
    if not hasattr(saved, "save_pretrained"):
        from safetensors.torch import save_model

        (tmp_path / "single").mkdir()
        save_model(saved, str(tmp_path / "single" / "model.safetensors"))
        return saved, {"single": str(tmp_path / "single")}
    folders = {"single": str(tmp_path / "single"), "sharded": str(tmp_path / "sharded")}
    saved.save_pretrained(folders["single"])
    saved.save_pretrained(folders["sharded"], max_shard_size="40KB")
    with open(os.path.join(folders["sharded"], "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1, "the sharded save has one file"
    return saved, folders


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model_type", ["llama-tied", "phi3", "llama3-debug"])
def test_materialize_and_load_checkpoint_on_two_ranks(model_type: str, tmp_path) -> None:
    saved, folders = _checkpoints(model_type, tmp_path)
    ids = _ids(saved)
    ranks = run_on_gloo(w.materialize_and_load, world_size=2, timeout_s=240,
                        args=(model_type, _plan(model_type, ids), folders, ids))
    ref = _one_process(model_type)
    want_init = {k: v.detach() for k, v in ref.state_dict().items()}
    loss = w.loss_of(ref, ids)
    loss.backward()
    with torch.no_grad():
        file_logits = w.logits_of(saved, ids)
    file_state = saved.state_dict()
    tied = model_type == "llama-tied"
    for rank, got in enumerate(ranks):
        _assert_equal(got["init"], want_init, f"rank {rank}: materialize(seed=0) vs one process's init_weights")
        torch.testing.assert_close(got["loss"], loss.detach(), **TOL)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
        for tag in folders:
            _assert_equal(got[tag]["state"], file_state, f"rank {rank}: load_checkpoint ({tag}) vs the file")
            torch.testing.assert_close(got[tag]["logits"], file_logits, **TOL)
            if model_type != "llama3-debug":
                read = got[tag]["read"]
                assert ("lm_head.weight" in read) != tied and "model.embed_tokens.weight" in read, sorted(read)
    _assert_each_rank_read_its_share(ranks, file_state, folders)
    want_trunc = _one_process(model_type, init=w.trunc_normal_all).state_dict()
    for rank, got in enumerate(ranks):
        _assert_equal(got["trunc_normal"], want_trunc, f"rank {rank}: init=trunc_normal_all vs one process")
        assert "random generators differ" in got["unseeded"] and "seed=" in got["unseeded"], got["unseeded"]


def _assert_each_rank_read_its_share(ranks: list[dict], file_state: dict, folders: dict) -> None:
    sharded = ranks[0]["is_sharded"]
    assert sum(file_state[k].nbytes for k in sharded if sharded[k]) > 0.8 * sum(v.nbytes for v in file_state.values())
    for tag in folders:
        for key, n in ((k, file_state[k].nbytes) for k in ranks[0][tag]["read"]):
            per_rank = [r[tag]["read"][key] for r in ranks]
            if sharded[key]:
                assert per_rank == [n // 2, n // 2], f"{tag} {key}: ranks read {per_rank} of {n} bytes"
            else:
                assert per_rank == [n, n], f"{tag} {key}: ranks read {per_rank} of {n} bytes"


def test_materialize_a_preset_equals_building_it_on_cpu() -> None:
    """The presets' documented property, one process: init_weights(seed) after to_empty gives
    the weights and RoPE tables of a model built on the CPU from that seed (GPT-2: tied)."""
    from shardplan.models.presets import build_preset

    for name in ("llama3-debug", "gpt2-debug"):
        model = shardplan.materialize(build_preset(name, device="meta"), seed=3)
        want = build_preset(name, device="cpu", seed=3)
        _assert_equal(dict(model.state_dict()), dict(want.state_dict()), name)
        for key, buf in want.named_buffers():
            assert torch.equal(model.get_buffer(key), buf), key


def test_materialize_says_what_it_cannot_do() -> None:
    from shardplan.models.presets import build_preset

    def params_only(model):
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    with pytest.raises(ValueError, match=r"left 2 tensors unset.*rope_cos \(non-persistent buffer of Transformer\)"):
        shardplan.materialize(build_preset("llama3-debug", device="meta"), init=params_only)
    with pytest.raises(ValueError, match=r"not on the meta device.*load_checkpoint"):
        shardplan.materialize(build_preset("llama3-debug", device="cpu"))
    with pytest.raises(ValueError, match="init must be a callable"):
        shardplan.materialize(build_preset("llama3-debug", device="meta"), init="normal")


def test_load_checkpoint_into_a_plain_model_and_its_errors(tmp_path) -> None:
    """Without DTensors every tensor is read whole: the one-process loader, and the errors."""
    saved = w.build("phi3", "cpu", seed=1)
    saved.save_pretrained(str(tmp_path / "phi3"))
    model = shardplan.materialize(w.build("phi3", "meta"), seed=0)
    shardplan.load_checkpoint(model, tmp_path / "phi3" / "model.safetensors")
    _assert_equal(dict(model.state_dict()), dict(saved.state_dict()), "plain load")
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in saved.state_dict().items()}
    (tmp_path / "short").mkdir()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"} | {"extra.bias": torch.zeros(2)},
              str(tmp_path / "short" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 \['lm_head.weight'\], unexpected 1 \['extra.bias'\].*strict=False"):
        shardplan.load_checkpoint(model, tmp_path / "short")
    shardplan.load_checkpoint(model, tmp_path / "short", strict=False)  # the rest loads
    (tmp_path / "wrong").mkdir()
    save_file(state | {"model.norm.weight": torch.zeros(3)}, str(tmp_path / "wrong" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' .* has shape \(3,\); the model's is"):
        shardplan.load_checkpoint(model, tmp_path / "wrong")
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        shardplan.load_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match=r"is on the meta device.*materialize"):
        shardplan.load_checkpoint(w.build("phi3", "meta"), tmp_path / "phi3")


def test_load_checkpoint_refuses_a_converted_layout(tmp_path) -> None:
    """transformers saves Mixtral's expert bank per expert (w1/w2/w3); its modules hold one
    fused gate_up_proj: the error names the keys and says what to do instead."""
    saved = w.build("mixtral", "cpu", seed=1)
    saved.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*another layout.*from_pretrained"):
        shardplan.load_checkpoint(w.build("mixtral", "cpu", seed=2), tmp_path)
