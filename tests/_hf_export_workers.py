"""Spawn-importable worker for ``tests/test_hf_export_styles.py``: every saved tiny model loaded
with transformers' own tensor-parallel loading, given shardplan's exported ``tp_plan`` dict.

``load_all(rank, world_size, cases)`` runs on every rank under
``shardplan.tools.launch.run_on_gloo`` (which has already joined the ranks into one gloo default
process group, and ends them with a barrier and ``destroy_process_group``). ``cases`` is a list
of ``(name, folder, tp_plan, input_ids, max_new_tokens)``; for each, in turn, this rank:

* loads ``from_pretrained(folder, distributed_config=DistributedConfig(tp_size=world_size,
  tp_plan=tp_plan), dtype=torch.float32)``;
* runs ``input_ids`` in eval mode under ``no_grad`` (full logits back, a DTensor gathered);
* runs greedy ``generate(input_ids, max_new_tokens=..., do_sample=False)`` with the KV cache;
* records the plan transformers resolved (``model.tp_plan``) and, for every parameter, its
  local tensor (``to_local()`` of a DTensor), global shape and placements.

Kept apart from the test module so the children never import pytest.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported, in the spawned child too

import torch
from torch.distributed.tensor import DTensor


def _param_record(p: torch.Tensor) -> dict[str, Any]:
    if isinstance(p, DTensor):
        return {"dtensor": True, "placements": [str(pl) for pl in p.placements], "global_shape": tuple(p.shape),
                "local": p.to_local().detach().clone()}
    return {"dtensor": False, "placements": [], "global_shape": tuple(p.shape), "local": p.detach().clone()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def load_all(rank: int, world_size: int, cases: list[tuple]) -> dict[str, dict[str, Any]]:
    from transformers import AutoModelForCausalLM, DistributedConfig

    out: dict[str, dict[str, Any]] = {}
    for name, folder, tp_plan, input_ids, max_new_tokens in cases:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        config = DistributedConfig(tp_size=world_size, tp_plan=dict(tp_plan))
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=config, dtype=torch.float32).eval()
        load_s = time.perf_counter() - t0
        with torch.no_grad():
            logits = _full(model(input_ids=input_ids).logits)
            tokens = _full(model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=max_new_tokens, pad_token_id=0))
        out[name] = {
            "logits": logits,
            "tokens": tokens,
            "resolved_tp_plan": dict(model.tp_plan or {}),
            "tp_size": getattr(model, "_tp_size", None),
            "params": {n: _param_record(p) for n, p in model.named_parameters()},
            "load_s": load_s,
            "total_s": time.perf_counter() - t0,
        }
        del model
    return out
