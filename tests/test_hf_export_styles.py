"""Every style shardplan emits for Hugging Face models, handed to transformers' own TP loading.

For each tiny random-weight model (hidden 64, 2 layers, vocab 128, float32; built from a config,
nothing downloaded, ``HF_HUB_OFFLINE=1``) the test plans it with shardplan at tp=2, exports the
plan with ``Plan.to_hf_tp_plan(model)``, ``save_pretrained``\\s it into a tmp folder, and, in ONE
gloo launch of 2 ranks (``tests/_hf_export_workers.py``), each rank loads each folder in turn with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, tp_plan=exported))``.
Checked on every rank, against the unsharded model loaded from the same folder in this process:

* the logits within 1e-5 abs, and greedy ``generate(max_new_tokens=4, do_sample=False)`` (KV
  cache on) giving the same tokens;
* transformers applied exactly the exported dict (its resolved plan holds every exported key with
  the exported style; it may add its own rules only for parameters shardplan did not style);
* every parameter's local tensor is exactly what shardplan's plan gives this rank: its half of the
  checkpoint tensor on the dim the style splits ([gate_r; up_r] for packed_colwise, the expert
  bank's up on X and down on I for moe_tp_experts), or the whole tensor for modules kept whole.

Cases and the styles they export (``CASES``):

=================  ============================================================================
llama              embedding_rowwise, colwise, rowwise, colwise_gather_output (lm_head), replicate
llama_tied         the same with ``tie_word_embeddings=True`` (one tensor, two styles, Shard(0))
llama_budget       ``memory_budget=5e6``: the MLPs, embeddings and head kept whole (``replicate``
                   overriding transformers' default plan for them)
phi3               fused qkv_proj ``colwise_gather_output`` (sliced into q, k, v by global widths),
                   o_proj ``colwise_gather_output``, gate_up_proj ``packed_colwise``
phi3_hf_plan       phi3's own HF plan priced by shardplan (``from_hf_tp_plan``):
                   ``rowwise_split_input`` and ``colwise_gather_output`` for gate_up_proj
qwen3_moe          ``moe_tp_experts`` (with its bank's gate_up_proj/down_proj keys) and
                   ``replicated_with_grad_allreduce`` (q_norm/k_norm)
mixtral            ``moe_tp_experts`` in a model whose expert weights are named the same
=================  ============================================================================

Refused (``ValueError`` naming the module and what to do; one test each below): GPT-2's Conv1D
weights (no HF style splits [in, out]), packed_colwise of 3 parts (HF's splits 2), a packed
projection with a bias, sequence parallelism, per-rank attribute values (OPT's ``num_heads``),
layouts HF's style of that name does not have (OLMo-2's q_norm output), a container's own split
parameters (gpt-oss sinks), one KV head kept whole with a partial gradient (already refused before),
and packed_colwise / moe_tp_experts without the model.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

import shardplan  # noqa: E402
from shardplan.analyze.graph import expert_params  # noqa: E402
from shardplan.plan.model import expand_pattern  # noqa: E402
from shardplan.tools.launch import run_on_gloo  # noqa: E402
from tests import _hf_export_workers as workers  # noqa: E402

TP = 2
ATOL = 1e-5  # measured max |tp - ref| here: ~2e-7 (2-core x86, torch 2.13 CPU)
NEW_TOKENS = 4
SEQ_LEN = 12
LAUNCH_TIMEOUT_S = 240.0
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64, use_cache=False,
             tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)


def _config(model_type: str, **overrides):
    cfg = transformers.AutoConfig.for_model(model_type)
    for key, value in {**SMALL, **overrides}.items():
        setattr(cfg, key, value)
    return cfg


def _build(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(model_type, **overrides)).float().eval()
    for p in model.parameters():  # norms start at 1.0 and biases at 0: random values, so a swap shows
        if p.dim() == 1:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
    return model


def _phi3_hf_plan(model, ids):
    from shardplan.interop.hf import from_hf_tp_plan, hf_tp_plan

    return from_hf_tp_plan(hf_tp_plan(model), model=model, mesh={"tp": TP}, example_inputs=(ids,))


_INSIDE = {"model.layers.*.mlp.experts": "moe_tp_experts"}

# name -> (model type, config overrides, plan_model options or a planning function, styles the export must hold)
CASES = {
    "llama": ("llama", {}, {}, {"embedding_rowwise", "colwise", "rowwise", "colwise_gather_output", "replicate"}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, {}, {"embedding_rowwise", "colwise_gather_output"}),
    "llama_budget": ("llama", {}, {"memory_budget": 5_000_000}, {"colwise", "rowwise", "replicate"}),
    # shardplan packs Phi-3's q/k/v by unequal parts ([2, 1, 1]), which HF refuses (see below):
    # pinned whole, as the refusal says, the export still carries the [gate; up] pack
    "phi3": ("phi3", {"pad_token_id": 0}, {"_pinned": {"model.layers.*.self_attn.qkv_proj": "colwise_gather_output"}},
             {"colwise_gather_output", "packed_colwise", "rowwise"}),
    "phi3_hf_plan": ("phi3", {"pad_token_id": 0}, _phi3_hf_plan, {"colwise_gather_output", "rowwise_split_input"}),
    # tiny banks plan moe_whole_experts, which HF's tp_plan lacks (see below): pinned split inside
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 16,
                                "decoder_sparse_step": 1, "mlp_only_layers": []}, {"_pinned": _INSIDE},
                  {"moe_tp_experts", "replicated_with_grad_allreduce", "packed_colwise", "colwise", "rowwise"}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, {"_pinned": _INSIDE},
                {"moe_tp_experts", "packed_colwise"}),
}


def _split(tensor: torch.Tensor, dim: int, rank: int, packed: int = 1) -> torch.Tensor:
    """This rank's part of ``tensor`` split tp ways on ``dim``; ``packed`` parts each split so."""
    return torch.cat([part.chunk(TP, dim=dim)[rank] for part in tensor.chunk(packed, dim=dim)], dim=dim)


def _expected_local(experts: dict, plan: shardplan.Plan, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What shardplan's plan gives ``rank`` of the checkpoint tensor ``name``."""
    module, _, leaf = name.rpartition(".")
    styles = plan.module_styles()
    style = styles.get(module)
    if style == "moe_tp_experts":  # shardplan's: up [E, X, H] split on X ([gate_r; up_r] when packed), down on I
        ep = experts[module]
        if leaf == ep.up:
            return _split(full, ep.up_dim, rank, 2 if ep.packed else 1)
        if leaf == ep.down:
            return _split(full, ep.down_dim, rank)
        raise AssertionError(f"{name}: a parameter of an expert bank this test does not know")
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
        return _split(full, 0, rank)
    if style in ("rowwise", "rowwise_split_input"):
        return _split(full, 1, rank) if leaf == "weight" else full
    if style == "packed_colwise":
        return _split(full, 0, rank, 2)
    return full  # replicate, replicated_with_grad_allreduce, modules no rule names


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per case: the saved folder, the plan and its export, the input ids, the reference run."""
    out = {}
    for name, (model_type, overrides, how, _) in CASES.items():
        model = _build(model_type, **overrides)
        ids = torch.randint(0, 128, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
        plan = how(model, ids) if callable(how) else shardplan.plan_model(
            model, {"tp": TP}, example_inputs=(ids,), explain=False, **how)
        hf_plan = plan.to_hf_tp_plan(model)
        folder = tmp_path_factory.mktemp(name)
        model.config.use_cache = True  # generate with the KV cache (on each rank: its own kv heads)
        model.save_pretrained(folder)
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = ref(input_ids=ids).logits
            own = model(input_ids=ids).logits
            tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert torch.allclose(logits, own, rtol=0.0, atol=1e-6), f"{name}: save/load changed the model"
        assert logits.std() > 0.05, f"{name}: degenerate reference logits"
        assert list(folder.glob("*.safetensors")), f"{name}: save_pretrained wrote no safetensors file"
        # the parameters as transformers loads them in one process (MoE checkpoints are saved in
        # their legacy per-expert layout and converted back on load)
        checkpoint = {k: v.detach().clone() for k, v in ref.named_parameters()}
        styles = plan.module_styles()
        experts = {fqn: expert_params(mod) for fqn, mod in ref.named_modules() if styles.get(fqn) == "moe_tp_experts"}
        out[name] = {"folder": str(folder), "plan": plan, "hf_plan": hf_plan, "ids": ids, "logits": logits,
                     "tokens": tokens, "checkpoint": checkpoint, "experts": experts}
    return out


@pytest.fixture(scope="module")
def gloo_results(cases):
    jobs = [(n, c["folder"], c["hf_plan"], c["ids"], NEW_TOKENS) for n, c in cases.items()]
    t0 = time.perf_counter()
    results = run_on_gloo(workers.load_all, world_size=TP, args=(jobs,), timeout_s=LAUNCH_TIMEOUT_S)
    print(f"\ngloo launch ({TP} ranks, {len(jobs)} models each): {time.perf_counter() - t0:.1f}s")
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_exported_plan_loads_in_transformers_as_shardplan_planned(name, cases, gloo_results) -> None:
    case = cases[name]
    hf_plan, plan, checkpoint = case["hf_plan"], case["plan"], case["checkpoint"]
    want = CASES[name][3]
    assert want <= set(hf_plan.values()), f"{name}: export lacks {want - set(hf_plan.values())}: {hf_plan}"
    assert len(gloo_results) == TP
    worst, split = 0.0, set()
    for rank, by_case in enumerate(gloo_results):
        where, res = f"{name} rank {rank}", by_case[name]
        resolved = res["resolved_tp_plan"]
        assert {k: resolved.get(k) for k in hf_plan} == hf_plan, f"{where}: transformers resolved {resolved}"
        # transformers' own default rules may stay only where they style nothing (dense-MLP keys of
        # a model whose every layer is MoE)
        generic = {".".join("*" if p.isdigit() else p for p in n.split(".")) for n in checkpoint}
        extra = {k: v for k, v in resolved.items() if k not in hf_plan and any(g == k or g.startswith(k + ".") for g in generic)}
        assert not extra, f"{where}: transformers styled modules with rules of its own: {extra}"
        assert res["tp_size"] == TP

        params = res["params"]
        assert sorted(params) == sorted(checkpoint), f"{where}: {sorted(set(params) ^ set(checkpoint))}"
        for pname, rec in params.items():
            full = checkpoint[pname]
            assert tuple(rec["global_shape"]) == tuple(full.shape), f"{where}: {pname} global {rec['global_shape']}"
            mine = _expected_local(case["experts"], plan, pname, full, rank)
            assert tuple(rec["local"].shape) == tuple(mine.shape) and torch.equal(rec["local"], mine), (
                f"{where}: {pname} holds {tuple(rec['local'].shape)} {rec['placements']}, not shardplan's "
                f"{tuple(mine.shape)} part of the checkpoint")
            if mine.shape != full.shape:
                split.add(pname)

        logits = res["logits"]
        assert tuple(logits.shape) == tuple(case["logits"].shape) and torch.isfinite(logits).all(), where
        diff = float((logits.double() - case["logits"].double()).abs().max())
        assert diff <= ATOL, f"{where}: max |tp - ref| logits = {diff:.3e} > {ATOL:g}"
        worst = max(worst, diff)
        assert torch.equal(res["tokens"], case["tokens"]), (
            f"{where}: greedy generate gave {res['tokens'][:, SEQ_LEN:].tolist()}, "
            f"one process {case['tokens'][:, SEQ_LEN:].tolist()}")
    kept_whole = [m for r in plan.rules if r.style not in ("replicate", "replicated_with_grad_allreduce")
                  for m in expand_pattern(r.module, plan.model.repeats)
                  if any(p.startswith(m + ".") for p in checkpoint) and not any(p.startswith(m + ".") for p in split)]
    assert not kept_whole, f"{name}: modules the plan splits came out whole: {kept_whole}"
    print(f"\n{name}: styles {sorted(set(hf_plan.values()))}; max |logits tp - ref| = {worst:.2e}; "
          f"generate equal; {len(split)} tensors split")


# --------------------------------------------------------------------------- refusals


def _plan(model_type: str, model=None, **options):
    model = model if model is not None else _build(model_type, **({"pad_token_id": 0} if model_type == "phi3" else {}))
    ids = torch.randint(0, 128, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, shardplan.plan_model(model, {"tp": TP}, example_inputs=(ids,), explain=False, **options)


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_conv1d_weights_are_refused() -> None:
    """GPT-2's Conv1D stores [in, out]: HF's colwise/rowwise need nn.Linear's out_features /
    in_features, and its packed_colwise would split dim 0, the input features, silently."""
    model, plan = _plan("gpt2", _gpt2())
    assert plan.rule_for("transformer.h.0.attn.c_attn").style == "packed_colwise"
    with pytest.raises(ValueError, match=r"transformer\.h\.\*\.attn\.c_attn: packed_colwise of 3 fused parts.*splits two"):
        plan.to_hf_tp_plan(model)
    # with c_attn out of the way, the Conv1D itself is what is refused
    rules = [r.model_copy(update={"style": "replicate", "packed": None}) if r.style == "packed_colwise" else r
             for r in plan.rules]
    plain = plan.model_copy(update={"rules": rules, "attributes": []})
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_proj: rowwise of a Conv1D \(weight \[in, out\]\)"
                                         r".*split only nn\.Linear.*apply_plan"):
        plain.to_hf_tp_plan(model)


def test_unequal_packed_parts_are_refused() -> None:
    """Phi-3's q/k/v slices of 4 query and 2 kv heads: shardplan's PackedShard [2, 1, 1]."""
    model, plan = _plan("phi3", _build("phi3", pad_token_id=0))
    assert plan.rule_for("model.layers.0.self_attn.qkv_proj").packed == [2, 1, 1]
    with pytest.raises(ValueError, match=r"qkv_proj: packed_colwise of \[2, 1, 1\] fused parts.*splits two"):
        plan.to_hf_tp_plan(model)


def test_a_packed_projection_with_a_bias_is_refused() -> None:
    """HF's packed_colwise cuts a 1-D bias in contiguous halves, not [gate_r; up_r]."""
    model = _build("phi3", pad_token_id=0)
    for layer in model.model.layers:
        old = layer.mlp.gate_up_proj
        layer.mlp.gate_up_proj = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    model, plan = _plan("phi3", model, **CASES["phi3"][2])
    assert plan.rule_for("model.layers.0.mlp.gate_up_proj").style == "packed_colwise"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj: packed_colwise of a fused projection "
                                         r"with a bias.*contiguous halves"):
        plan.to_hf_tp_plan(model)


@pytest.mark.parametrize("model_type", ["phi3", "qwen3_moe"])
def test_packed_and_expert_styles_need_the_model(model_type: str) -> None:
    overrides = CASES["phi3" if model_type == "phi3" else "qwen3_moe"][1]
    model, plan = _plan(model_type, _build(model_type, **overrides), **CASES[model_type][2])
    with pytest.raises(ValueError, match=r"needs the model.*plan\.to_hf_tp_plan\(model\)"):
        plan.to_hf_tp_plan()
    assert plan.to_hf_tp_plan(model)


def test_sequence_parallel_is_refused() -> None:
    model, plan = _plan("llama", sequence_parallel=True)
    assert "sequence_parallel" in set(plan.module_styles().values())
    with pytest.raises(ValueError, match=r"activations split on the sequence.*plan with sequence_parallel=False"):
        plan.to_hf_tp_plan(model)


def test_whole_experts_per_rank_are_refused() -> None:
    model, plan = _plan("mixtral", _build("mixtral", num_local_experts=4, num_experts_per_tok=2),
                        _pinned={"model.layers.*.mlp.experts": "moe_whole_experts"})
    with pytest.raises(ValueError, match=r"moe_whole_experts .* no style in Hugging Face's tp_plan.*'moe_tp_experts'"):
        plan.to_hf_tp_plan(model)


def test_per_rank_attribute_values_are_refused() -> None:
    """OPT's attention views by ``self.num_heads`` (``view(b, -1, num_heads, d)``): shardplan sets
    it to 2 on each rank's shards; transformers would keep 4 and fold the heads into the sequence."""
    model, plan = _plan("opt")
    assert plan.attributes
    with pytest.raises(ValueError, match=r"self_attn: the plan gives its code per-rank sizes \{'num_heads': 2\}"
                                         r".*Hugging Face's loader does not"):
        plan.to_hf_tp_plan(model)


def test_layouts_hf_styles_do_not_have_are_refused() -> None:
    """OLMo-2 normalizes q over all heads: shardplan keeps q_norm whole and hands its output on
    split (``replicate`` with output Shard(2)); HF's "replicate" leaves it whole."""
    model, plan = _plan("olmo2")
    with pytest.raises(ValueError, match=r"q_norm: replicate with input default / output Shard\(2\), layouts Hugging "
                                         r"Face's 'replicate' does not have"):
        plan.to_hf_tp_plan(model)


def test_a_containers_own_split_parameters_are_refused() -> None:
    """gpt-oss's per-head attention sinks are split beside the heads (``param_layouts``)."""
    model, plan = _plan("gpt_oss", _build("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                          layer_types=["full_attention"] * 2), _pinned=_INSIDE)
    with pytest.raises(ValueError, match=r"self_attn: replicate with its own parameters split \(\{'sinks': 'Shard\(0\)'\}\)"):
        plan.to_hf_tp_plan(model)


def test_one_kv_head_kept_whole_is_refused() -> None:
    """One KV head cannot split: k_proj/v_proj are colwise_gather_output with a partial gradient."""
    model, plan = _plan("llama", _build("llama", num_key_value_heads=1))
    assert plan.rule_for("model.layers.0.self_attn.k_proj").style == "colwise_gather_output"
    with pytest.raises(ValueError, match=r"k_proj \(and 1 more\) use styles Hugging Face's tp_plan cannot express"):
        plan.to_hf_tp_plan(model)


def test_a_bias_cut_to_each_ranks_heads_is_refused() -> None:
    """Bloom's ALiBi (``[b * heads, 1, keys]``) is cut to each rank's heads where its attention
    receives it; a tp_plan has no entry for that, so Hugging Face's ranks would add the whole
    bias to scores of their own heads."""
    model, plan = _plan("bloom", sequence_parallel=False)
    assert plan.rule_for("transformer.h.0.self_attention.query_key_value").style == "colwise"
    with pytest.raises(ValueError, match=r"self_attention: its input 'alibi' is cut to each rank's heads"):
        plan.to_hf_tp_plan(model)
