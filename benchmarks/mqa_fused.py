"""Multi-query attention fused in one Linear, at real sizes: split by heads vs gathered.

For StarCoder's, SantaCoder's and a 64-head Falcon multi-query shape (``gpt_bigcode`` and
``falcon`` from transformers, built from configs on the meta device, nothing downloaded),
and gpt-fast-style code with one kv head and with 2 kv heads at tp=4, one table from one run:

* ``auto``: shardplan's plan; ``qkv`` its style for the fused projection (``packed_colwise
  +tail``: the query heads split tp ways, the k and v heads all-gathered whole on the ranks
  whose query heads read them, all of tp for one kv head);
* ``gathered``: the same model with that projection pinned to ``colwise_gather_output`` and
  its output projection to ``colwise_gather_output`` (attention whole on every rank: what
  the planner gave before, and what a plan without the layout must do);
* ``step``: predicted step time (h100-nvlink, batch 2 x seq 2048, bf16), ``ratio`` auto /
  gathered (below 1: the split is faster); ``GiB/dev``: parameter bytes per device of each;
  ``heads``: the auto plan splits attention by heads (fused projection packed, output
  projection rowwise).

Usage (repository root): ``python benchmarks/mqa_fused.py``. ~1 minute on 2 cores.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _hf(kind: str, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _gpt_fast(dim: int, heads: int, kv: int):
    from tests.portability.natural import FusedGQAAttention, FusedGQALM

    with torch.device("meta"):
        model = FusedGQALM(vocab=32000, dim=dim, layers=4)
        model.layers = torch.nn.ModuleList(FusedGQAAttention(dim, heads, kv) for _ in range(4))
    return model.to(torch.bfloat16)


CASES = [  # name, builder, tp, fused projection pattern, output projection pattern
    ("StarCoder 15B (48 heads)", lambda: _hf("gpt_bigcode", n_embd=6144, n_head=48, n_layer=40, n_positions=8192,
                                             vocab_size=49152, n_inner=24576, multi_query=True, bos_token_id=0,
                                             eos_token_id=0), 8, "transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj"),
    ("SantaCoder 1.1B (16 heads)", lambda: _hf("gpt_bigcode", n_embd=2048, n_head=16, n_layer=24, vocab_size=49280,
                                               multi_query=True, bos_token_id=0, eos_token_id=0), 4,
     "transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj"),
    ("Falcon MQA (64 heads, 32 layers)", lambda: _hf("falcon", hidden_size=4096, num_attention_heads=64,
                                                     num_hidden_layers=32, multi_query=True,
                                                     new_decoder_architecture=False), 8,
     "transformer.h.*.self_attention.query_key_value", "transformer.h.*.self_attention.dense"),
    ("gpt-fast, 1 kv head (32 heads)", lambda: _gpt_fast(4096, 32, 1), 8, "layers.*.wqkv", "layers.*.wo"),
    ("gpt-fast, Qwen2-1.5B attention (12 heads, 2 kv)", lambda: _gpt_fast(1536, 12, 2), 4, "layers.*.wqkv", "layers.*.wo"),
]


def _row(name: str, build, tp: int, qkv: str, out: str) -> str:
    import shardplan
    from shardplan.api import price_styles

    opts = dict(batch_size=2, seq_len=2048)
    start = time.process_time()
    auto = shardplan.plan_model(build(), {"tp": tp}, explain=False, **opts)
    seconds = time.process_time() - start
    gathered = price_styles(build(), {"tp": tp}, {qkv: "colwise_gather_output", out: "colwise_gather_output"}, **opts)
    first = auto.rule_for(qkv.replace("*", "0"))
    style = first.style + ("+tail" if first.whole_parts else "")
    split = "yes" if auto.rule_for(out.replace("*", "0")).style == "rowwise" and first.style == "packed_colwise" else "no"
    a, g = auto.estimate, gathered.estimate
    return (f"| {name} | {tp} | {style} | {a.step_time_s * 1e3:.1f} | {g.step_time_s * 1e3:.1f} | "
            f"{a.step_time_s / g.step_time_s:.3f} | {a.param_bytes_per_device / 2**30:.2f} | "
            f"{g.param_bytes_per_device / 2**30:.2f} | {split} | {seconds:.1f} |")


def main() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    print("| model | tp | qkv | auto step ms | gathered step ms | ratio | auto GiB/dev | gathered GiB/dev | split by heads | plan s (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        try:
            print(_row(*case), flush=True)
        except Exception as exc:  # noqa: BLE001 - one row per model, the error in it
            print(f"| {case[0]} | {case[2]} | error: {type(exc).__name__}: {str(exc)[:120]} |||||||")


if __name__ == "__main__":
    main()
