"""Every transformers causal-LM type, planned with ``sequence_parallel=True`` at tp=2.

For each type (``--types``; default: every type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) the
tiny config (``hf-tiny:<type>``) is built on meta and planned on ``{"tp": 2}`` with sequence
parallelism asked for. Per type: ``ok`` (and how many norms take ``sequence_parallel``, how
many are kept whole and named in a warning), or the first line of why not: a tiny config
transformers cannot build (``build``), a model neither front end traces on these inputs
(``trace``), or the planner's refusal (``refused``). ``--verify`` also runs each planned type on
2 gloo ranks against one process (``shardplan verify``: outputs, loss, every gradient).

Usage (repository root): ``python benchmarks/sp_sweep.py [--types llama,opt] [--verify]``.
About 2 minutes on 2 cores; ``--verify`` adds about 40 s per planned type.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEPT = "kept whole under sequence_parallel=True"


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def plan_one(model_type: str) -> tuple[str, str]:
    """(outcome, detail) for one type."""
    import shardplan
    from shardplan.analyze.trace import TraceError
    from shardplan.interop.hf import build_hf_model

    try:
        model, inputs, kwargs = build_hf_model(model_type, tiny=True)
    except Exception as exc:  # noqa: BLE001 - a tiny config transformers cannot build
        return "build", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:
        plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs,
                                    sequence_parallel=True, explain=False)
    except TraceError as exc:
        return "trace", str(exc).splitlines()[0][:160]
    except ValueError as exc:
        return "refused", str(exc).splitlines()[0][:200]
    styles = plan.module_styles()
    split = sum(s == "sequence_parallel" for s in styles.values())
    kept = sum(KEPT in w for w in plan.warnings)
    return "ok", f"{split} sequence_parallel, {kept} kept whole (warned)"


def verify_one(model_type: str) -> str:
    from shardplan.tools.verify import verify

    try:
        result = verify(f"hf-tiny:{model_type}", nproc=2, timeout_s=400, sequence_parallel=True)
    except Exception as exc:  # noqa: BLE001 - a rank that fails is a result here
        return f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return "PASS" if result.passed else f"FAIL {', '.join(result.problems)[:160]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="")
    parser.add_argument("--verify", action="store_true", help="run each planned type on 2 gloo ranks")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    types = args.types.split(",") if args.types else causal_lm_types()
    print(f"# sp sweep: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {len(types)} causal-LM types, tp=2, sequence_parallel=True")
    counts: collections.Counter = collections.Counter()
    for t in types:
        outcome, detail = plan_one(t)
        counts[outcome] += 1
        if outcome == "ok" and args.verify:
            check = verify_one(t)
            counts[f"verify {check.split()[0]}"] += 1
            detail += f"; {check}"
        print(f"{t:28s} {outcome:8s} {detail}", flush=True)
    built = len(types) - counts["build"]
    print(f"# {counts['ok']} of {built} types that build plan with sequence parallel "
          f"({counts['trace']} do not trace, {counts['refused']} refused); "
          + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k.startswith("verify")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
