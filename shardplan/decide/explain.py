"""Explain: for each weight module, what each alternative style would have cost.

Contract
--------
``explain_decisions(graph, solution, ctx)`` re-solves the placement program once per
weight module and rejected style, with that module forced to the style and everything
else free to re-optimize under the same objective. Each :class:`~shardplan.plan.Decision`
lists the alternatives with their predicted step time and parameter bytes per device, or
why none exists (a dimension that does not divide, or no consistent plan around it).
Repeated blocks are explained once, through their representative.
"""

from __future__ import annotations

from dataclasses import replace

from ..analyze.graph import OpGraph
from ..plan.model import Alternative, Decision
from .solve import Solution, SolveContext, solve
from .strategies import op_strategies

__all__ = ["explain_decisions"]


def explain_decisions(graph: OpGraph, solution: Solution, ctx: SolveContext) -> list[Decision]:
    decisions = []
    for op in graph.ops:
        if op.kind != "module":
            continue
        chosen = solution.strategies[op.index].name
        names = sorted({s.name for s in op_strategies(op, graph, tp=ctx.tp, opts=ctx.opts)} - {chosen})
        alternatives = [_alternative(graph, ctx, op.index, name) for name in names]
        for module in _rule_names(graph, op.target):  # one per rule the module's choice became
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


def _rule_names(graph: OpGraph, fqn: str) -> list[str]:
    from .assemble import pattern_map, patterned  # the plan's rule names

    return patterned(fqn, graph, pattern_map(graph))
