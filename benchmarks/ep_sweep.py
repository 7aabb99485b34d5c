"""Every transformers type that ships a ``base_model_ep_plan``, planned at ep=2 and run on 2 gloo ranks.

For each type (``--types``; default: every type whose default config has a
``base_model_ep_plan``), the tiny config (``hf-tiny:<type>``) is planned on ``{"ep": 2}``, and
the plan applied with FSDP on 2 gloo ranks, each rank its own rows of the batch, against one
process on the whole batch (``tests/_ep_workers.planned_matches``): the largest logits
difference, the largest gradient difference relative to that gradient's largest entry, and the
same for the weights after 2 AdamW steps. A type that does not plan prints why (a tiny config
transformers cannot build, a bank not called with its routing, no MoE layer in 2 layers).
Routers that sample in training mode (PhiMoE) run in eval mode (``--eval``).

Usage (repository root): ``python benchmarks/ep_sweep.py [--types olmoe,phimoe] [--eval]``.
About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ep_types() -> list[str]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for t in sorted(CONFIG_MAPPING_NAMES):
        try:
            if getattr(transformers.AutoConfig.for_model(t), "base_model_ep_plan", None):
                out.append(t)
        except Exception:  # noqa: BLE001 - a config that does not build has no plan to read
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="")
    parser.add_argument("--eval", action="store_true", help="run the models in eval mode (deterministic routers)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import shardplan
    import tests._ep_workers as w
    from shardplan.interop.hf import build_hf_model
    from shardplan.tools.launch import run_on_gloo

    types = args.types.split(",") if args.types else ep_types()
    print(f"# ep sweep: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {len(types)} types, ep=2, FSDP, {'eval' if args.eval else 'train'}")
    cases = []
    for t in types:
        try:
            model, inputs, kwargs = build_hf_model(t, tiny=True)
            plan = shardplan.plan_model(model, {"ep": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
            cases.append((t, plan.to_yaml()))
        except Exception as exc:  # noqa: BLE001 - a row of the table
            print(f"{t:28s} not planned: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    results = run_on_gloo(w.planned_families_safe, world_size=2, args=(cases, True, ("ep",), not args.eval),
                          timeout_s=3000)[0]
    print(f"{'type':28s} {'logits':>8} {'grads':>8} {'weights':>8}")
    for t, _ in cases:
        r = results[t]
        if "error" in r:
            print(f"{t:28s} failed on the ranks: {r['error'][:120]}")
            continue
        print(f"{t:28s} {r['logits']:8.1e} {max(r['grads'].values()):8.1e} {max(r['weights'].values()):8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
