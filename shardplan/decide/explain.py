"""Explain: for each weight module, what each alternative style would have cost.

Contract
--------
``explain_decisions(graph, solution, ctx)`` re-solves the placement program once per
weight module and rejected style, with that module forced to the style and everything
else free to re-optimize under the same objective. Each :class:`~shardplan.plan.Decision`
lists the alternatives with their predicted step time and parameter bytes per device, or
why none exists (a dimension that does not divide, or no consistent plan around it).
Repeated blocks are explained once, through their representative.

``modules`` narrows the modules explained (``shardplan explain FQN`` prices one; an
unfolded export graph prices the rule each merged block keeps). Re-solves are bounded by
count, never by time, so the plan file is the same on every machine: past
``max_resolves`` a module's alternatives are listed unpriced, with the reason. Only a
model whose blocks do not fold reaches the bound (folded llama3-405b needs 37).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..analyze.graph import OpGraph
from ..plan.model import Alternative, Decision
from .solve import Solution, SolveContext, solve
from .strategies import op_strategies

__all__ = ["explain_decisions", "MAX_RESOLVES"]

MAX_RESOLVES = 256  # folded models need far fewer: llama3-405b 37, qwen3_next 75, deepseek_v3 94


def explain_decisions(graph: OpGraph, solution: Solution, ctx: SolveContext, *,
                      modules: Callable[[str], bool] | None = None, max_resolves: int = MAX_RESOLVES) -> list[Decision]:
    decisions = []
    left = max_resolves
    for op in graph.ops:
        names_of_rules = _rule_names(graph, op.target) if op.kind == "module" else []
        if not names_of_rules or (modules is not None and not any(map(modules, names_of_rules))):
            continue
        chosen = solution.strategies[op.index].name
        names = sorted({s.name for s in op_strategies(op, graph, tp=ctx.tp, opts=ctx.opts)} - {chosen})
        if len(names) > left:  # stop at the first module past the bound, so the cut is one place in program order
            left = 0
            alternatives = [Alternative(style=name, reason=_unpriced(max_resolves)) for name in names]
        else:
            left -= len(names)
            alternatives = [_alternative(graph, ctx, op.index, name) for name in names]
        for module in names_of_rules:  # one per rule the module's choice became
            decisions.append(Decision(
                module=module, style=chosen, step_time_s=solution.time_s,
                param_bytes_per_device=solution.param_bytes, alternatives=alternatives,
            ))
    return decisions


def _alternative(graph: OpGraph, ctx: SolveContext, op_index: int, name: str) -> Alternative:
    try:
        alt = solve(graph, replace(ctx, forced={**ctx.forced, op_index: name}))
    except ValueError as exc:  # PlanningError, or a budget no plan with this style meets
        return Alternative(style=name, reason=str(exc).split(";")[0])
    return Alternative(style=name, step_time_s=alt.time_s, param_bytes_per_device=alt.param_bytes)


def _unpriced(max_resolves: int) -> str:
    return (f"not priced: explain re-solves at most {max_resolves} alternatives per plan, and this model's blocks "
            "do not fold into fewer; `shardplan explain MODULE` prices one module")


def _rule_names(graph: OpGraph, fqn: str) -> list[str]:
    from .assemble import pattern_map, patterned  # the plan's rule names

    return patterned(fqn, graph, pattern_map(graph))
