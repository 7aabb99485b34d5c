"""HF agreement: shardplan's automatic plan vs the tp_plan transformers ships, over every model type.

For every ``transformers`` model type whose config class has a ``base_model_tp_plan`` (from
``CONFIG_MAPPING_NAMES``; ``--subconfigs`` adds types whose plan sits on a sub-config such as
``text_config``), built from ``AutoConfig.for_model`` on the meta device at FULL size
(``AutoModelForCausalLM``, else ``AutoModel``; nothing is downloaded), this:

1. plans it at tp=2 with ``explain=False`` on token ids of ``--batch`` x ``--seq``;
2. compares, for every Linear-like weight HF's plan covers (``shardplan.interop.hf.agreement``:
   nn.Linear / Conv1D, embeddings and MoE expert banks), the style family of the two plans;
3. where they differ, re-plans once with ``explain=True`` so every difference has the plan's
   own reason (skipped if the model's time is spent).

Each model runs in a long-lived child process with a per-model time limit (``--timeout``, 60 s):
a model past it is killed, reported as a timeout at the stage it was in, and the child is
restarted. Output (stdout): one line per failure (stage: config/build/trace/plan, and the
reason), one line per model with differences, then the summary: how many built, traced and
planned; decoder-only families that did not plan; agreement by parameter count and by module
count (Linear weights; + embeddings; + expert banks); the top disagreement reasons.

Targets: every decoder-only family plans; agreement >= 95% of HF-planned Linear weights.

Usage (from the repo root)::

    python benchmarks/hf_agreement.py                 # the full sweep (~10 min on 2 cores)
    python benchmarks/hf_agreement.py --limit 20
    python benchmarks/hf_agreement.py --types llama,phi3,mixtral -v
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MESH = {"tp": 2}


# --------------------------------------------------------------------------- which model types


def model_types(subconfigs: bool) -> list[tuple[str, str]]:
    """(model_type, "config" | "sub-config") for every type with a base_model_tp_plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for mt in CONFIG_MAPPING_NAMES:
        try:
            cls = transformers.CONFIG_MAPPING[mt]
        except Exception:  # noqa: BLE001 - a config class that does not import: not counted
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append((mt, "config"))
        elif subconfigs and any(
            getattr(v, "base_model_tp_plan", None) for v in (getattr(cls, "sub_configs", None) or {}).values()
            if isinstance(v, type)
        ):
            out.append((mt, "sub-config"))
    return out


# --------------------------------------------------------------------------- the child


def _short(exc: BaseException, limit: int = 320) -> str:
    """Head and tail of the message: the tail of a TraceError names the underlying error."""
    text = f"{type(exc).__name__}: " + " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 140] + " ... " + text[-135:]


def _cause(plan, fqn: str, hf_style: str, reason: str) -> str:
    """Why the plan differs from HF here, as a short model-independent category."""
    from shardplan.interop import hf

    want = hf.HF_TO_SHARDPLAN.get(hf_style)
    try:
        d = plan.explain(fqn)
    except ValueError:
        d = None
    if d is not None:
        alts = [a for a in d.alternatives if a.style == want] or [
            a for a in d.alternatives if hf.style_family(a.style) == hf.style_family(hf_style)
        ]
        feasible = [a for a in alts if a.step_time_s is not None]
        if alts and not feasible:
            return f"HF's style infeasible in shardplan: {alts[0].reason or 'no consistent plan'}"
        if feasible:
            a = min(feasible, key=lambda a: (a.param_bytes_per_device or 0.0, a.step_time_s))
            dm = (a.param_bytes_per_device or 0.0) - d.param_bytes_per_device
            dt = a.step_time_s - d.step_time_s
            if dm > 0:
                return "HF's style keeps more parameter bytes per device (objective: least parameter bytes first)"
            if abs(dt) <= 1e-6 * max(d.step_time_s, 1e-12):
                return "cost tie: HF's style predicted equally fast (tie broken the other way)"
            return "cost model: HF's style slower" if dt > 0 else "HF's style faster at equal memory (solver suboptimal?)"
    rule = plan.rule_for(fqn)
    if d is None and rule is not None and rule.why:
        # a folded instance whose rule has no decision of its own: the rule's ``why`` lists
        # the alternatives as "style: 1.2 ms slower" / "+2 MiB/device" / "tie" / the reason
        alts = dict(part.split(": ", 1) for part in rule.why.split("; ") if ": " in part)
        text = alts.get(want) or next((t for st, t in alts.items() if hf.style_family(st) == hf.style_family(hf_style)), None)
        if text is not None:
            if "/device" in text:
                return "HF's style keeps more parameter bytes per device (objective: least parameter bytes first)"
            if text == "tie":
                return "cost tie: HF's style predicted equally fast (tie broken the other way)"
            if text.endswith("slower"):
                return "cost model: HF's style slower"
            return f"HF's style infeasible in shardplan: {text}"
    if "no tensor-parallel style" in reason:
        return "module kind has no tensor-parallel style in shardplan (replicated)"
    if "no dimension of it divides" in reason:
        return "weight does not divide by tp"
    if "not called in forward" in reason:
        return "module not called in forward with these inputs (replicated)"
    if "output all-gathered" in reason:
        return "output gathered (heads/reshape not divisible by tp)"
    return "(no decision recorded)" if not reason else "other: " + reason[:80]


def _rows(model, plan) -> list[tuple]:
    """(fqn, hf_style, our_style, same_family, reason, kind, numel, cause) per compared module."""
    from shardplan.interop import hf

    rows = []
    for r in hf.agreement(model, plan):
        mod = model.get_submodule(r.fqn)
        numel = sum(p.numel() for p in mod.parameters(recurse=False))
        kind = hf.weight_kind(mod)
        if kind == "other" and hf.style_family(r.hf_style) == "experts":
            kind = "experts"  # an expert bank the core does not recognize
        cause = "" if r.same_family else _cause(plan, r.fqn, r.hf_style, r.reason)
        rows.append((r.fqn, r.hf_style, r.our_style, r.same_family, r.reason, kind, numel, cause))
    return rows


def _one(conn, model_type: str, opts: dict[str, Any]) -> None:
    import shardplan
    from shardplan.interop import hf
    from shardplan.analyze.trace import TraceError

    res: dict[str, Any] = {"type": model_type, "failed": None, "reason": "", "seconds": {}}
    t0 = time.perf_counter()
    conn.send(("stage", "build"))
    try:
        model, inputs, kwargs = hf.build_hf_model(
            model_type, device="meta", batch_size=opts["batch"], seq_len=opts["seq"],
        )
    except Exception as exc:  # noqa: BLE001 - reported
        res.update(failed="build", reason=_short(exc), full=str(exc)[-2000:])
        conn.send(("done", res))
        return
    res["seconds"]["build"] = time.perf_counter() - t0
    res["class"] = type(model).__name__
    cfg = model.config
    res["decoder_only"] = bool(type(model).__name__.endswith("ForCausalLM") and not getattr(cfg, "is_encoder_decoder", False))
    res["hf_keys"] = len(hf.hf_tp_plan(model))
    res["params"] = sum(p.numel() for p in model.parameters())
    conn.send(("stage", "plan"))
    t1 = time.perf_counter()
    try:
        plan = shardplan.plan_model(model, MESH, example_inputs=inputs, example_kwargs=kwargs or None, explain=False)
    except TraceError as exc:
        res.update(failed="trace", reason=_short(exc), full=str(exc)[-2000:])
        conn.send(("done", res))
        return
    except Exception as exc:  # noqa: BLE001 - reported
        res.update(failed="plan", reason=_short(exc), full=f"{type(exc).__name__}: {exc}"[-2000:],
                   where=traceback.format_exc(limit=-2))
        conn.send(("done", res))
        return
    res["seconds"]["plan"] = time.perf_counter() - t1
    res["rows"] = _rows(model, plan)
    res["warnings"] = list(plan.warnings)
    if not opts["explain"] or all(r[3] for r in res["rows"]):
        conn.send(("done", res))
        return
    conn.send(("partial", res))  # kept if explaining runs out of time
    conn.send(("stage", "explain"))
    t2 = time.perf_counter()
    try:
        explained = shardplan.plan_model(model, MESH, example_inputs=inputs, example_kwargs=kwargs or None, explain=True)
        res["rows"] = _rows(model, explained)
        res["explained"] = True
    except Exception as exc:  # noqa: BLE001 - the explain=False rows stand
        res["explain_error"] = _short(exc)
    res["seconds"]["explain"] = time.perf_counter() - t2
    conn.send(("done", res))


def child_main(conn, opts: dict[str, Any]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            _one(conn, msg, opts)
        except Exception as exc:  # noqa: BLE001 - never let one model end the child
            conn.send(("done", {"type": msg, "failed": "plan", "reason": "internal: " + _short(exc), "seconds": {}}))


class Runner:
    """A child process that plans one model at a time; killed and restarted on a timeout."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=child_main, args=(child, self.opts), daemon=True)
        self.proc.start()
        self.conn = parent
        if not parent.poll(180):
            raise RuntimeError("the planning child did not start within 180 s")
        parent.recv()

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
        self.proc = self.conn = None

    def run(self, model_type: str, timeout: float) -> dict[str, Any]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(model_type)
        deadline = time.monotonic() + timeout
        stage, partial = "build", None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                self._kill()
                if partial is not None:
                    partial["explain_error"] = f"explain=True past the {timeout:.0f} s limit"
                    return partial
                return {"type": model_type, "failed": stage, "reason": f"timeout: over {timeout:.0f} s", "seconds": {}}
            try:
                kind, payload = self.conn.recv()
            except EOFError:
                self._kill()
                return {"type": model_type, "failed": stage, "reason": "the planning process died (out of memory?)",
                        "seconds": {}}
            if kind == "stage":
                stage = {"plan": "plan", "build": "build"}.get(payload, stage)
            elif kind == "partial":
                partial = payload
            elif kind == "done":
                return payload

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
        if self.proc is not None:
            self.proc.join(10)
            if self.proc.is_alive():
                self._kill()


# --------------------------------------------------------------------------- summary


def reason_key(row: tuple) -> str:
    """A short, model-independent category for a difference."""
    _fqn, hf_style, ours, _same, _reason, kind, _numel, cause = row
    return f"{kind}: HF {hf_style} -> shardplan {ours}: {cause}"


FAILURES = [  # (needle in the message, category); first match wins
    ("transformers has no model class", "build: no Auto model class for this (sub-)config"),
    ("RecursionError", "trace [core]: get_attr of a parameter/buffer recurses (_compute_meta under the getattr patch)"),
    ("no shape is known for getattr", "trace [core]: attribute proxy (MetaAttribute) has no meta (_meta_of)"),
    ("Proxy object cannot be iterated", "trace [core]: a plain tensor attribute indexed by a proxy"),
    ("does not support item assignment", "trace [core]: in-place setitem on a proxy"),
    ("'str' object has no attribute 'type'", "trace [core]: device attribute traced as the string 'meta'"),
    ("NotImplementedError: argument of type", "trace [core]: a non-tensor argument fx cannot represent (custom container, a class)"),
    ("Expected inputs of BF16", "trace: an op that needs bf16 inputs (the model is built in float32)"),
    ("KeyError", "plan [core]: KeyError on traced.calls of a module that never ran (nested fold / unused module)"),
    ("reshape() takes 1 positional argument", "trace [core]: x.size(0) traced as the whole size (torch MetaProxy.size `if dim`)"),
    ("nonzero", "trace: data-dependent indexing (boolean mask / nonzero)"),
    ("missing 1 required positional argument", "inputs: forward needs more than token ids / pixels (harness)"),
    ("running its shards", "plan [core]: local-shard check of a sharded op failed"),
    ("timeout", "timeout"),
]


def failure_key(r: dict[str, Any]) -> str:
    text = r.get("full") or r.get("reason", "")
    for needle, key in FAILURES:
        if needle in text:
            return key
    if r["failed"] == "build":
        return "build: the default config does not build (transformers)"
    first = text.split(":")[0].strip() or "?"
    return f"{r['failed']}: {first}"


def _pct(a: float, b: float) -> str:
    return f"{100.0 * a / b:.2f}%" if b else "n/a"


def summarize(results: list[dict[str, Any]], wall: float) -> None:
    n = len(results)
    failed = Counter(r["failed"] for r in results if r["failed"])
    built = n - failed["build"] - failed["config"]
    traced = built - failed["trace"]
    planned = traced - failed["plan"]
    print("\n== summary ==")
    print(f"model types: {n}; built {built}, traced {traced}, planned {planned} (tp=2, explain=False); wall {wall:.0f} s")
    for stage in ("build", "trace", "plan"):
        if failed[stage]:
            print(f"  failed at {stage}: {failed[stage]}")
    cats: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if r["failed"]:
            cats[failure_key(r)].append(r["type"])
    if cats:
        print("failures by cause:")
        for k, names in sorted(cats.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(names):>3}  {k}  [{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}]")
    dec = [r for r in results if r.get("decoder_only")]
    dec_bad = [r for r in dec if r["failed"]]
    print(f"decoder-only (*ForCausalLM) built: {len(dec)}; planned {len(dec) - len(dec_bad)}"
          + (f"; NOT planned: {', '.join(r['type'] + ' (' + r['failed'] + ')' for r in dec_bad)}" if dec_bad else ""))
    groups = {
        "Linear weights (nn.Linear, Conv1D)": ("linear",),
        "Linear + embeddings": ("linear", "embedding"),
        "Linear + embeddings + MoE expert banks": ("linear", "embedding", "experts"),
    }
    rows = [row for r in results for row in r.get("rows", [])]
    with_rows = sum(1 for r in results if r.get("rows"))
    print(f"models with HF-planned Linear-like weights compared: {with_rows}")
    for label, kinds in groups.items():
        sel = [row for row in rows if row[5] in kinds]
        same = [row for row in sel if row[3]]
        p_all, p_same = sum(row[6] for row in sel), sum(row[6] for row in same)
        print(f"  agreement, {label}: by parameters {_pct(p_same, p_all)} ({p_same:,} / {p_all:,}); "
              f"by modules {_pct(len(same), len(sel))} ({len(same)} / {len(sel)})")
    from shardplan.interop.hf import HF_TO_SHARDPLAN

    sel = [row for row in rows if row[5] in ("linear", "embedding", "experts")]
    exact = [row for row in sel if HF_TO_SHARDPLAN.get(row[1]) == row[2]]
    print(f"  exact style (HF's name mapped to shardplan's, not just the family), Linear + embeddings + experts: "
          f"by parameters {_pct(sum(r[6] for r in exact), sum(r[6] for r in sel))}; "
          f"by modules {_pct(len(exact), len(sel))}")
    diffs = [row for row in rows if not row[3]]
    if diffs:
        by_params: dict[str, int] = defaultdict(int)
        by_mods: Counter = Counter()
        models: dict[str, set] = defaultdict(set)
        owner = {id(row): r["type"] for r in results for row in r.get("rows", [])}
        for row in diffs:
            k = reason_key(row)
            by_params[k] += row[6]
            by_mods[k] += 1
            models[k].add(owner[id(row)])
        total = sum(row[6] for row in rows if row[5] in ("linear", "embedding", "experts"))
        print("top disagreement reasons (share of all compared parameters; modules; model types):")
        for k, p in sorted(by_params.items(), key=lambda kv: -kv[1])[:12]:
            names = sorted(models[k])
            print(f"  {_pct(p, total):>7}  {by_mods[k]:>6} modules  {len(names):>3} types  {k}"
                  f"  [{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}]")


def print_model(r: dict[str, Any], verbose: bool) -> None:
    if r["failed"]:
        print(f"FAIL {r['type']} [{r['failed']}] {r['reason']}", flush=True)
        return
    rows = r.get("rows", [])
    diffs = [row for row in rows if not row[3]]
    secs = " ".join(f"{k} {v:.1f}s" for k, v in r["seconds"].items())
    if diffs:
        p_all = sum(row[6] for row in rows)
        p_same = sum(row[6] for row in rows if row[3])
        print(f"DIFF {r['type']} ({r.get('class')}): {len(rows) - len(diffs)}/{len(rows)} modules, "
              f"{_pct(p_same, p_all)} of params agree; {secs}"
              + (f"; explain: {r['explain_error']}" if r.get("explain_error") else ""), flush=True)
        seen = set()
        for row in diffs:
            generic = re.sub(r"\.\d+\.", ".*.", row[0])
            if generic in seen:
                continue
            seen.add(generic)
            print(f"    {generic}: HF {row[1]} vs shardplan {row[2]} ({row[5]}): {row[7]}")
            print(f"        reason: {row[4][:300] or '(none)'}")
    elif verbose:
        print(f"ok   {r['type']}: {len(rows)} modules agree; {secs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: every type with a base_model_tp_plan)")
    ap.add_argument("--limit", type=int, help="only the first N model types")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per model (default 60)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--no-explain", action="store_true", help="do not re-plan with explain=True for differences")
    ap.add_argument("--subconfigs", action="store_true", help="also types whose plan is on a sub-config (text_config)")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line for every model, not only differences")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.types:
        types = [t.strip() for t in args.types.split(",") if t.strip()]
    else:
        types = [t for t, _ in model_types(args.subconfigs)]
    if args.limit:
        types = types[: args.limit]
    print(f"{len(types)} model types; tp=2; inputs {args.batch} x {args.seq} token ids; "
          f"{args.timeout:.0f} s per model", flush=True)
    runner = Runner({"batch": args.batch, "seq": args.seq, "explain": not args.no_explain})
    results = []
    try:
        for mt in types:
            r = runner.run(mt, args.timeout)
            results.append(r)
            print_model(r, args.verbose)
    finally:
        runner.close()
    summarize(results, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
