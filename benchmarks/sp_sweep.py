"""Every transformers causal-LM type, planned with ``sequence_parallel=True`` at tp=2.

For each type (``--types``; default: every type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) the
tiny config (``hf-tiny:<type>``) is built on meta and planned on ``{"tp": 2}`` with sequence
parallelism asked for. Per type: ``ok`` (and how many norms take ``sequence_parallel``, how
many are kept whole and named in a warning), or the first line of why not: a tiny config
transformers cannot build (``build``), a model neither front end traces on these inputs
(``trace``), or the planner's refusal (``refused``). ``--verify`` also runs each planned type on
2 gloo ranks against one process (``shardplan verify``: outputs, loss, every gradient).
Beside each outcome, ``heads k/n``: k of the type's n attention modules split by heads
(``benchmarks/ecosystem.py``'s rule: q/k/v colwise, packed or kv-grouped, the output
projection rowwise), with the projections' styles of each one that is not; a type refused
under sequence parallel, or with an attention not split under it, is counted again on its
plan without it (the summary counts that plan).

Usage (repository root): ``python benchmarks/sp_sweep.py [--types llama,opt] [--verify]``.
About 12 minutes on 2 cores; ``--verify`` adds about 40 s per planned type.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
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
    return "ok", f"{split} sequence_parallel, {kept} kept whole (warned); {heads(model, plan)}"


def heads(model, plan) -> str:
    """``heads k/n`` (see the module doc), and the styles of the attentions not split."""
    from benchmarks.ecosystem import attention_modules, split_by_heads
    from shardplan.interop.hf import hf_tp_plan

    ours = plan.module_styles()
    library = hf_tp_plan(model)  # patterns (layers.*.q_proj): named per module as the plan's are
    theirs = {fqn: style for fqn, _ in model.named_modules() for pattern, style in library.items()
              if fnmatch.fnmatchcase(fqn, pattern)}
    found = attention_modules(model, ours, theirs)
    whole = [a for a in found if not split_by_heads(a, ours, plan.tp)]
    # q/k gathered for a norm over all heads (OLMo 2's q_norm), each rank then keeping its heads'
    # features: attention itself runs split, as vLLM runs it; counted apart, not as split
    after_norm = [a for a in whole if _split_after_a_norm(a, ours, plan)]
    whole = [a for a in whole if a not in after_norm]
    text = f"heads {len(found) - len(whole) - len(after_norm)}/{len(found)}"
    text += f" (+{len(after_norm)} split after a gathered norm)" if after_norm else ""
    if whole:
        a = whole[0]
        text += " WHOLE " + ", ".join(f"{m[len(a.fqn) + 1:]} {ours.get(m, 'replicate')}" for m in a.q + a.kv + a.out)
    return text


def _split_after_a_norm(attn, ours: dict[str, str], plan) -> bool:
    from benchmarks.ecosystem import SPLIT_COLWISE, SPLIT_ROWWISE

    norms = [m for m, s in ours.items() if m.startswith(attn.fqn + ".") and s == "replicate"
             and (plan.rule_for(m).output_layouts or "").startswith("Shard")]
    gathered = [m for m in attn.q + attn.kv if ours.get(m) == "colwise_gather_output"]
    return (bool(norms) and bool(gathered) and bool(attn.out)
            and all(ours.get(m) in SPLIT_COLWISE + ("colwise_gather_output",) for m in attn.q + attn.kv)
            and all(ours.get(m) in SPLIT_ROWWISE for m in attn.out))


def heads_without_sequence_parallel(model_type: str) -> str:
    import shardplan
    from shardplan.interop.hf import build_hf_model

    model, inputs, kwargs = build_hf_model(model_type, tiny=True)
    try:
        plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False)
    except ValueError as exc:
        return "refused without it too: " + str(exc).splitlines()[0][:120]
    return heads(model, plan)


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
        if outcome == "refused" or " WHOLE " in detail:
            detail += "; without sequence parallel: " + heads_without_sequence_parallel(t)
        counts["heads whole"] += " WHOLE " in detail.rpartition("without sequence parallel")[2]
        if outcome == "ok" and args.verify:
            check = verify_one(t)
            counts[f"verify {check.split()[0]}"] += 1
            detail += f"; {check}"
        print(f"{t:28s} {outcome:8s} {detail}", flush=True)
    built = len(types) - counts["build"]
    print(f"# {counts['ok']} of {built} types that build plan with sequence parallel "
          f"({counts['trace']} do not trace, {counts['refused']} refused); "
          f"{counts['heads whole']} types with an attention not split by heads; "
          + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k.startswith("verify")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
