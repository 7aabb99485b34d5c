"""Numerical proof that shardplan's tensor-parallel plans compute the unsharded model.

Every case is planned here, in the parent (meta device, no process group), written to
YAML and sent as text to real gloo ranks (``shardplan.tools.launch.run_on_gloo``), which
rebuild it with ``Plan.from_yaml`` -- so the plans are also shown to survive
serialization. Each rank builds a float32 reference model and an identical copy
(``build_preset(name, device="cpu", seed=0)``), applies the plan to the copy on a
1-D ``("tp",)`` mesh and compares, against the reference run in the same process:

* ``out``   the forward output (logits / MLP output);
* ``loss``  a scalar loss (cross-entropy against fixed targets for the LMs, MSE
            against a fixed target for the MLP);
* ``grad``  every parameter's gradient (``full_tensor()``; the tied GPT-2
            ``wte.weight``/``lm_head.weight`` once, by name);
* ``param`` every parameter after one ``AdamW(lr=1e-2, foreach=True)`` step;
* ``step``  every parameter after the step vs the *unsharded* AdamW step taken
            with the TP model's own gathered gradients (isolates the sharded
            optimizer step from gradient roundoff, see the tolerances);
* ``out_after_step``         the forward after the step vs that unsharded model;
* ``out_after_step_vs_ref``  the forward after the step vs the reference model.

plus structural checks: same parameter names, every parameter a DTensor, some
really sharded (local numel = full / tp), ties preserved, no gradient missing or
left ``Partial``, every weight moved by the step.

All cases of one tensor-parallel degree share one gloo launch (module-scoped
fixture), so the file runs in ~30 s on 2 CPU cores. Every case runs twice: at the
batch the plan was made for (2) and at batch 4 -- plans do not depend on batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests._checks import assert_parameter_checks

import shardplan
from shardplan.tools.launch import run_on_gloo
from shardplan.models.presets import build_preset, get_preset
from tests import _numerics_workers as workers

PLAN_BATCH = 2
OTHER_BATCH = 4
LAUNCH_TIMEOUT_S = 240.0

# Tolerances, float32, as (atol, rtol) with |tp - ref| <= atol + rtol * |ref| per element.
# Measured on this machine (2-core x86 CPU, torch 2.13 CPU, 1 thread per rank), worst over all
# cases, ranks and both batches; each tolerance is ~10-20x the worst value seen:
#
# * out   worst 8.3e-7 (llama3-debug, |logits| <= 2.5)  -> atol 1e-5.
#   A row-parallel Linear sums tp partial dot products and then all-reduces; the reference
#   does one matmul over the whole inner dimension, so the float32 reduction order differs
#   (a few ulps per layer, compounding over the layers).
# * loss  worst 4.8e-7 (1 ulp of a loss ~6.4)            -> atol 1e-5.
# * grad  worst 1.3e-7 (gpt2 c_proj.bias, |grad| <= 0.33) -> atol 2e-6.  Same reason as
#   ``out``, in the backward matmuls and the gradient all-reduces.
# * param worst 1.9e-4                                    -> atol 2e-3.  Loose on purpose:
#   AdamW's first step moves each element by lr * g / (|g| + eps) (eps = 1e-8), so where
#   |g| ~ eps a gradient roundoff of ~1e-9 changes the step by up to lr * dg / eps ~ 1e-3.
#   The worst element seen (layers.1.attention.wk.weight) has g = -4.9e-9 on TP vs -4.5e-9
#   on the reference: steps differ by 1.9e-4. A sign error or a wrong gradient would move
#   an element by ~2 * lr = 2e-2 and still fail; the tight checks are ``grad`` and ``step``.
# * step  worst 0 (bitwise equal)                         -> atol 1e-7, rtol 1e-6 (a few ulps):
#   AdamW is elementwise, so stepping shards must equal stepping the gathered tensor.
# * out_after_step          worst 7.8e-7                  -> atol 1e-5 (as ``out``).
# * out_after_step_vs_ref   worst 1.3e-4 (|logits| ~ 3)   -> atol 2e-3 (as ``param``).
TOLS: dict[str, tuple[float, float]] = {
    "out": (1e-5, 0.0),
    "loss": (1e-5, 0.0),
    "grad": (2e-6, 0.0),
    "param": (2e-3, 0.0),
    "step": (1e-7, 1e-6),
    "out_after_step": (1e-5, 0.0),
    "out_after_step_vs_ref": (2e-3, 0.0),
}
assert set(TOLS) == set(workers.CATEGORIES)


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    opts: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.name}-tp{self.tp}" + "".join(f"-{k}" for k, v in sorted(self.opts.items()) if v)


CASES = [
    Case("llama3-debug", 2),
    Case("llama3-debug", 4),
    Case("gpt2-debug", 2),
    Case("gpt2-debug", 4),
    Case("mlp", 2),
    Case("mlp", 4),
    Case("llama3-debug", 2, {"sequence_parallel": True}),
    Case("parallel-debug", 2),
    Case("llama3-debug", 2, {"loss_parallel": True}),
    # a learned position embedding beside sequence-sharded tokens: replicated, its output sliced
    Case("gpt2-debug", 2, {"sequence_parallel": True}),
    Case("parallel-debug", 2, {"sequence_parallel": True}),
]
_BY_ID = {c.id: c for c in CASES}
assert len(_BY_ID) == len(CASES)

_plans: dict[str, shardplan.Plan] = {}


def plan_for(case: Case) -> shardplan.Plan:
    """The plan, made in this process on the meta device at batch ``PLAN_BATCH``."""
    if case.id not in _plans:
        preset = get_preset(case.name)
        _plans[case.id] = shardplan.plan_model(
            build_preset(case.name, device="meta"), {"tp": case.tp},
            example_inputs=preset.example_inputs(batch_size=PLAN_BATCH, device="meta"),
            explain=False, **case.opts,
        )
    return _plans[case.id]


def _run_id(case: Case, batch: int) -> str:
    return f"{case.id}-b{batch}"


@pytest.fixture(scope="module")
def gloo_results():
    """``get(case, batch)`` -> per-rank result dicts; one gloo launch per tp degree, lazily."""
    launches: dict[int, Any] = {}

    def get(case: Case, batch: int) -> list[dict[str, Any]]:
        if case.tp not in launches:
            runs = [
                {"id": _run_id(c, b), "name": c.name, "plan_yaml": plan_for(c).to_yaml(), "batch_size": b}
                for c in CASES if c.tp == case.tp for b in (PLAN_BATCH, OTHER_BATCH)
            ]
            try:
                launches[case.tp] = run_on_gloo(
                    workers.run_cases, world_size=case.tp, args=(runs, TOLS), timeout_s=LAUNCH_TIMEOUT_S,
                )
            except Exception as exc:  # every case of this degree reports the same failure
                launches[case.tp] = exc
        got = launches[case.tp]
        if isinstance(got, Exception):
            raise AssertionError(f"the tp={case.tp} gloo launch failed: {got}") from got
        rid = _run_id(case, batch)
        out = []
        for rank, by_id in enumerate(got):
            if rid not in by_id:
                failed = [k for k, v in by_id.items() if "error" in v]
                raise AssertionError(f"{rid} did not run on rank {rank}: an earlier case failed first ({failed})")
            out.append(by_id[rid])
        return out

    return get


def _format(res: dict[str, Any]) -> str:
    return "  ".join(f"{c}={res[c]['max_abs']:.1e}" for c in workers.CATEGORIES)


def _assert_matches_reference(case: Case, batch: int, ranks: list[dict[str, Any]]) -> None:
    rid = _run_id(case, batch)
    for rank, res in enumerate(ranks):
        where = f"{rid} rank {rank}"
        assert "error" not in res, f"{where} raised:\n{res.get('error')}"
        ck = res["checks"]
        assert ck["plan_batch_size"] == PLAN_BATCH, where
        assert_parameter_checks(ck, where)
        assert not ck["missing_grads"], f"{where}: no gradient for {ck['missing_grads']}"
        assert not ck["partial_grads"], f"{where}: gradients left Partial after backward: {ck['partial_grads']}"
        assert not ck["unmoved_params"], f"{where}: the AdamW step did not move {ck['unmoved_params']}"
        bad = {
            c: f"max |tp - ref| = {res[c]['max_abs']:.3e} at {res[c]['worst']} (worst vs tolerance "
               f"{res[c]['ratio']:.2f}x at {res[c]['ratio_worst']}; atol, rtol = {TOLS[c]}; top {res[c]['top']})"
            for c in workers.CATEGORIES if not res[c]["ratio"] <= 1.0
        }
        assert not bad, f"{where} differs from the unsharded reference:\n" + "\n".join(f"  {c}: {m}" for c, m in bad.items())
    print(f"\n{rid}: {_format(ranks[0])}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_survives_yaml_and_is_the_plan_under_test(case: Case) -> None:
    plan = plan_for(case)
    again = shardplan.Plan.from_yaml(plan.to_yaml())
    assert again == plan
    assert again.to_yaml() == plan.to_yaml()
    assert plan.tp == case.tp
    assert plan.options.batch_size == PLAN_BATCH
    styles = set(plan.module_styles().values())
    assert styles & {"colwise", "rowwise", "colwise_gather_output", "embedding_rowwise"}, styles
    if case.opts.get("sequence_parallel"):
        assert "sequence_parallel" in styles, f"sequence_parallel=True produced no sequence-parallel rule: {styles}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tp_matches_unsharded_reference(case: Case, gloo_results) -> None:
    _assert_matches_reference(case, PLAN_BATCH, gloo_results(case, PLAN_BATCH))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_made_at_batch_2_is_exact_at_batch_4(case: Case, gloo_results) -> None:
    _assert_matches_reference(case, OTHER_BATCH, gloo_results(case, OTHER_BATCH))
