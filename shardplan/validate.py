"""Validate: does a plan fit a model? The findings ``shardplan check`` lists.

Contract
--------
``check_findings(plan, model)`` returns one line per problem applying ``plan`` to ``model``
would hit: a fingerprint that differs, a rule or region that matches no module, a module
with parameters no rule covers, a split dimension that the tp size does not divide (styles
that gather at once tolerate uneven splits). Empty when the plan fits. ``apply_plan`` warns
with the same lines, so user intent is never silently ignored.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_findings"]

_UNEVEN_OK = ("colwise_gather_output", "embedding_rowwise")


def _owns_params(module: Any) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _divisibility(rule: Any, hits: list[str], modules: dict[str, Any], tp: int) -> list[str]:
    """A finding when the dim a style splits does not divide by tp (uneven-tolerant styles aside)."""
    from .report import sharded_dim, weight_of

    if rule.style in _UNEVEN_OK and not (rule.output_layouts or "").startswith("Shard"):
        return []
    bad = []
    for fqn in hits:
        mod = modules[fqn]
        weight, dim = weight_of(mod), sharded_dim(rule.style, mod)
        if weight is None or dim is None or dim >= weight.dim() or weight.shape[dim] % tp == 0:
            continue
        bad.append((fqn, dim, int(weight.shape[dim])))
    if not bad:
        return []
    fqn, dim, size = bad[0]
    more = f" (and {len(bad) - 1} more of its modules)" if len(bad) > 1 else ""
    return [f"{fqn}: {rule.style} splits weight dim {dim} of size {size}, which tp={tp} does not divide{more}"]


def check_findings(plan: Any, model: Any, *, where: Any = None) -> list[str]:
    """Problems applying ``plan`` to ``model`` would hit; empty when it fits. ``where(key_path)``
    prefixes a finding with the file and line of that key (``shardplan check`` passes one)."""
    from .plan import fingerprint, matches

    at = where or (lambda _key: "")
    findings = []
    got = fingerprint(model)
    if got != plan.model.fingerprint:
        findings.append(f"{at(('model', 'fingerprint'))}fingerprint: the plan is for a {plan.model.class_name} with "
                        f"{plan.model.fingerprint}, the model is a {type(model).__name__} with {got}; "
                        "re-plan it with `shardplan plan`")
    modules = dict(model.named_modules())
    for i, rule in enumerate(plan.rules):
        hits = [fqn for fqn in modules if matches(rule.module, fqn)]
        if not hits:
            findings.append(f"{at(('rules', i, 'module'))}rule {rule.module} ({rule.style}): matches no module of the model")
        findings += [at(("rules", i, "style")) + f for f in _divisibility(rule, hits, modules, plan.tp)] if hits else []
    for i, region in enumerate(plan.regions):
        if not any(matches(region.module, fqn) for fqn in modules):
            findings.append(f"{at(('regions', i, 'module'))}region {region.module}: matches no module of the model")
    for fqn, mod in modules.items():
        if _owns_params(mod) and not any(matches(r.module, fqn) for r in plan.rules):
            findings.append(f"{fqn or '<root>'} ({type(mod).__name__}): owns parameters but no rule covers it")
    return findings
