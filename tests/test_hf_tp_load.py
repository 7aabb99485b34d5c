"""shardplan's plan, handed to Hugging Face: ``Plan.to_hf_tp_plan()`` -> ``from_pretrained`` on gloo.

Round trip: a tiny random-weight Llama (``transformers.LlamaConfig``: hidden 64, 2 layers, 4
heads, 2 KV heads, intermediate 128, vocab 128, float32, untied head) is saved with
``save_pretrained`` into a pytest tmp folder and planned by shardplan at tp=2
(``shardplan.plan_model(model, {"tp": 2}, example_inputs=(input_ids,))``). On 2 real gloo
ranks (``shardplan.tools.launch.run_on_gloo``) each rank loads the folder with transformers' own
tensor-parallel loading, given ``plan.to_hf_tp_plan()`` as the plan dict
(``tests/_hf_tp_load_workers.py``), and runs the same input ids. Checked on every rank:

* the logits equal those of the unsharded model loaded from the same folder in this process
  within 1e-5 abs (float32 reduction order moves them by ~1e-7; a wrong shard, a missing
  all-reduce or a wrong style moves them by O(1) or fails the forward);
* transformers applied exactly shardplan's plan: the plan it resolved (its own
  ``base_model_tp_plan`` merged with the dict, which only overrides rules) equals the dict;
* the model really was split, as the plan says: every weight a plan rule shards is a DTensor
  ``Shard(d)`` (d = 0 for colwise / colwise_gather_output / embedding_rowwise, 1 for rowwise)
  whose local tensor is exactly this rank's half of the checkpoint tensor; every other
  parameter holds the whole checkpoint tensor.

Two ways of passing the plan are tested, in the same launch: ``distributed_config=
DistributedConfig(tp_size=2, tp_plan=...)`` (the documented form) and the older standalone
``tp_plan=..., tp_size=2`` arguments (deprecated with a FutureWarning; skipped once transformers
stops reading them). Nothing is downloaded (``HF_HUB_OFFLINE=1``). One gloo launch for both;
the module takes ~15 s on an idle 2-core machine (transformers' import in each rank dominates).
"""

from __future__ import annotations

import inspect
import os
import re
import time

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import shardplan  # noqa: E402
from shardplan.tools.launch import run_on_gloo  # noqa: E402
from tests import _hf_tp_load_workers as workers  # noqa: E402

TP = 2
ATOL = 1e-5  # measured max |tp - ref| on this machine: ~1.6e-7 (2-core x86, torch 2.13 CPU)
LAUNCH_TIMEOUT_S = 120.0
SEQ_LEN = 16

# shardplan style of a module -> the dim its weight is split on (None: whole on every rank)
WEIGHT_SHARD_DIM = {"colwise": 0, "colwise_gather_output": 0, "embedding_rowwise": 0, "rowwise": 1, "replicate": None}
BIAS_SHARD_DIM = {"colwise": 0, "colwise_gather_output": 0, "rowwise": None, "replicate": None}


def _legacy_kwargs_supported() -> bool:
    """Whether from_pretrained still reads the standalone (deprecated) tp_plan/tp_size arguments."""
    src = inspect.getsource(transformers.PreTrainedModel.from_pretrained)
    return 'kwargs.pop("tp_plan"' in src and 'kwargs.pop("tp_size"' in src


def _tiny_llama_config():
    return transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False,
        use_cache=False, attention_dropout=0.0,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The saved folder, input ids, shardplan's plan and its HF dict, the reference logits."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config()).eval()
    for p in model.parameters():  # norms start at 1.0: give them random values too, so a swap shows
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
    input_ids = torch.randint(0, model.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(folder)

    plan = shardplan.plan_model(model, {"tp": TP}, example_inputs=(input_ids,))
    hf_plan = plan.to_hf_tp_plan()

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=input_ids).logits
        own_logits = model(input_ids=input_ids).logits
    assert torch.allclose(ref_logits, own_logits, rtol=0.0, atol=1e-6), "save_pretrained/from_pretrained changed the model"
    assert ref_logits.std() > 0.1, "degenerate reference logits"

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"save_pretrained wrote no safetensors file in {folder}"
    checkpoint = {k: v for f in files for k, v in load_file(f).items()}
    return {"folder": str(folder), "input_ids": input_ids, "plan": plan, "hf_plan": hf_plan,
            "ref_logits": ref_logits, "checkpoint": checkpoint}


@pytest.fixture(scope="module")
def gloo_results(setup):
    """One launch: every rank loads the folder both ways and runs the input ids."""
    ways = tuple(w for w in workers.WAYS if w != "tp_plan_kwarg" or _legacy_kwargs_supported())
    t0 = time.perf_counter()
    results = run_on_gloo(
        workers.load_and_run, world_size=TP, args=(setup["folder"], setup["hf_plan"], setup["input_ids"], ways),
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    print(f"\ngloo launch ({TP} ranks, {len(ways)} loads each): {time.perf_counter() - t0:.1f}s")
    return results


def _expected_shard_dims(plan: shardplan.Plan, param_names) -> dict[str, int | None]:
    """Parameter name -> the dim shardplan's plan splits it on (None: replicated)."""
    module_styles = plan.module_styles()  # concrete module names -> style
    out: dict[str, int | None] = {}
    for name in param_names:
        module, _, leaf = name.rpartition(".")
        style = module_styles.get(module, "replicate")
        table = WEIGHT_SHARD_DIM if leaf == "weight" else BIAS_SHARD_DIM
        if style not in table:
            raise AssertionError(f"{name}: style {style!r} of {module} is not covered by this test's layout table")
        out[name] = table[style]
    return out


def test_plan_uses_only_styles_transformers_knows(setup) -> None:
    import transformers.distributed.tensor_parallel  # noqa: F401 - registers the TP styles
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    hf_plan = setup["hf_plan"]
    unknown = sorted({s for s in hf_plan.values() if s not in ALL_PARALLEL_STYLES})
    assert not unknown, f"styles transformers does not know: {unknown}"
    sharding = {s for s in hf_plan.values() if s != "replicate"}
    assert {"colwise", "rowwise"} <= sharding, f"the tiny Llama's plan shards nothing useful: {hf_plan}"
    for key in hf_plan:
        assert not re.search(r"\.\d+\.", key), f"{key}: layer indices should be '*' patterns"


@pytest.mark.parametrize("way", workers.WAYS)
def test_hf_tp_load_of_shardplan_plan_matches_unsharded(way: str, setup, gloo_results) -> None:
    if way == "tp_plan_kwarg" and not _legacy_kwargs_supported():
        pytest.skip("this transformers no longer reads the standalone tp_plan/tp_size arguments")
    hf_plan, ref_logits, checkpoint = setup["hf_plan"], setup["ref_logits"], setup["checkpoint"]
    expected = _expected_shard_dims(setup["plan"], checkpoint)
    assert len(gloo_results) == TP
    worst = 0.0
    for rank, by_way in enumerate(gloo_results):
        where = f"{way} rank {rank}"
        res = by_way[way]

        # the plan transformers applied is exactly shardplan's
        assert res["resolved_tp_plan"] == hf_plan, (
            f"{where}: transformers resolved a different plan:\n"
            f"  only in transformers': {sorted(set(res['resolved_tp_plan'].items()) - set(hf_plan.items()))}\n"
            f"  only in shardplan's:   {sorted(set(hf_plan.items()) - set(res['resolved_tp_plan'].items()))}"
        )
        assert res["tp_size"] == TP, f"{where}: model._tp_size = {res['tp_size']}"
        mesh = res["mesh"]
        assert mesh is not None and mesh["device_type"] == "cpu", f"{where}: mesh {mesh}"
        assert dict(zip(mesh["names"], mesh["shape"])).get("tp") == TP, f"{where}: mesh {mesh}"

        # the model really is split the way the plan says, and each shard holds the right rows
        params = res["params"]
        assert sorted(params) == sorted(checkpoint), (
            f"{where}: parameters {sorted(set(params) ^ set(checkpoint))} differ from the checkpoint's"
        )
        halves = []
        for name, rec in params.items():
            want = checkpoint[name]
            assert tuple(rec["global_shape"]) == tuple(want.shape), f"{where}: {name} global shape {rec['global_shape']}"
            dim = expected[name]
            if dim is None:
                assert torch.equal(rec["local"], want), f"{where}: {name} should be whole on every rank"
                continue
            assert rec["dtensor"] and rec["shard_dims"] == [dim], (
                f"{where}: {name} should be a DTensor Shard({dim}), got dtensor={rec['dtensor']} {rec['placements']}"
            )
            mine = want.chunk(TP, dim=dim)[rank]
            assert tuple(rec["local"].shape) == tuple(mine.shape), (
                f"{where}: {name} local shape {tuple(rec['local'].shape)}, expected {tuple(mine.shape)}"
            )
            assert torch.equal(rec["local"], mine), f"{where}: {name} holds the wrong half of the checkpoint"
            halves.append(name)
        for must in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
            assert must in halves, f"{where}: {must} was not split (split: {halves})"

        # the same logits as the unsharded model, on every rank
        logits = res["logits"]
        assert tuple(logits.shape) == tuple(ref_logits.shape), f"{where}: logits shape {tuple(logits.shape)}"
        assert torch.isfinite(logits).all(), f"{where}: non-finite logits"
        diff = float((logits.double() - ref_logits.double()).abs().max())
        assert diff <= ATOL, f"{where}: max |tp - ref| logits = {diff:.3e} > {ATOL:g}"
        worst = max(worst, diff)
    print(f"\n{way}: max |logits tp - ref| = {worst:.2e} over {TP} ranks; "
          f"load {max(r[way]['load_s'] for r in gloo_results):.2f}s")
