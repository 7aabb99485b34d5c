"""Assemble: a solved graph -> the plan's rules and regions (its warnings: :mod:`.shortfalls`).

Contract
--------
Pure functions from (graph, solution, regions) to the pydantic pieces of a
:class:`~shardplan.plan.Plan`. Repeated blocks are written once as ``container.*``
patterns when the representative stands for every sibling, per instance otherwise. Every
weight-owning module gets exactly one rule (modules never called and containers that own
parameters included), so ``Plan.module_styles()`` covers the whole model.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from . import cost
from ..analyze.graph import OpGraph
from ..plan.model import LocalAttributes, LocalBuffers, Region, Rule, brace_ranges
from .buffers import buffer_layouts
from .folded import parts_of
from .placements import shard_dim
from .regions import Entry, PartialBlock, partial_grad_params
from .scatter import exits, flattened_from, is_cut, is_gather, is_scatter, is_sum, scatter_target
from .slices import is_slice, received_once, slice_target
from .solve import Solution
from .strategies import placement_str
from .weights import read_elsewhere

__all__ = ["pattern_map", "patterned", "rules", "regions", "group_norm_attributes", "block_regions", "unused_modules",
           "repeats", "merge_repeated", "merged_representatives"]


def pattern_map(graph: OpGraph) -> dict[str, str]:
    """Representative block prefix -> ``container.*`` when it stands for every sibling."""
    reps: dict[str, list[str]] = {}
    for inst, rep in graph.traced.folded.items():
        reps.setdefault(rep, []).append(inst)
    out = {}
    for rep, insts in reps.items():
        container, _, _ = rep.rpartition(".")
        siblings = {n for n, _ in graph.model.get_submodule(container).named_children()} if container else set()
        covered = {rep.rpartition(".")[2]} | {i.rpartition(".")[2] for i in insts}
        out[rep] = f"{container}.*" if siblings == covered else ""
    return out


def patterned(fqn: str, graph: OpGraph, pmap: dict[str, str]) -> list[str]:
    """The rule names for ``fqn``: its innermost representative block becomes the pattern
    for all of its copies, then each block around that one does the same (experts folded
    inside a representative layer: ``block.{1,5,9}.experts.*.wi``)."""
    rep = max((r for r in pmap if fqn == r or fqn.startswith(r + ".")), key=len, default=None)
    if rep is None:
        return [fqn]
    outer = {r: p for r, p in pmap.items() if rep.startswith(r + ".")}
    return [name + fqn[len(rep):] for head in _copies(rep, graph, pmap[rep]) for name in patterned(head, graph, outer)]


def _copies(rep: str, graph: OpGraph, pattern: str) -> list[str]:
    """Names for a representative block and its folded copies: ``container.*`` when they
    are every child, an index range, else each name."""
    if pattern:
        return [pattern]
    insts = [i for i, r in graph.traced.folded.items() if r == rep]
    container, _, first = rep.rpartition(".")
    names = [first] + [i.rpartition(".")[2] for i in insts]
    if container and all(n.isdigit() for n in names):  # one rule per kind of block
        return [f"{container}.{brace_ranges([int(n) for n in names])}"]
    return [rep] + insts


def rules(
    graph: OpGraph, solution: Solution, decisions: list, entries: list[Entry], blocks: list[PartialBlock]
) -> list[Rule]:
    pmap = pattern_map(graph)
    why = {d.module: d for d in decisions}
    # inside a region the input is already a Replicate DTensor: a Linear that re-declared
    # Shard(seq) would redistribute Replicate -> Replicate, whose backward all-reduces its
    # own Partial gradient and defeats the region
    in_region = {c for e in entries for _, inside in e.sites for c in inside}
    partial = {r for b in blocks for r in b.rowwise}
    returned = {v for op in graph.ops if op.kind == "output" for v in op.inputs}
    rules: list[Rule] = []
    seen: set[str] = set()
    for op in graph.ops:
        if op.kind != "module" or op.target in seen:
            continue  # a module called twice takes one style for both calls (the solver ties them)
        seen.add(op.target)
        s = solution.strategies[op.index]
        inp = None if op.index in in_region else _layout(s.layouts.get("input"))
        for module in patterned(op.target, graph, pmap):
            rules.append(Rule(
                module=module, style=s.name,
                input_layouts=inp, output_layouts=_rule_output(op, s, partial, returned),
                copy_output=s.name != "replicate" and _modified_in_place(graph, op),
                use_local_output=False if op.index in partial else None,
                packed=s.layouts.get("packed"), whole_parts=s.layouts.get("whole_parts"), groups=s.layouts.get("groups"),
                output_grad_partial=s.layouts.get("output_grad") == "P", input_grad_partial=s.layouts.get("input_grad") == "P",
                read_outside=op.target in read_elsewhere(graph),
                param_layouts={n: _layout(p) for n, p in s.layouts.get("params", {}).items()},
                partial_grads=list(s.layouts.get("partial_grads", ())),
                why=_why(why.get(patterned(op.target, graph, pmap)[0])),
            ))
    rules += [
        # a module whose parameters other code reads as tensors (a causal conv's weight handed
        # to F.conv1d): kept whole, and plain tensors while that code runs
        Rule(module=m, style="replicate", read_outside=_read_as_tensors(graph, fqn),
             why="not called in forward: kept whole")
        for fqn in unused_modules(graph) for m in patterned(fqn, graph, pmap)
    ]
    partial = partial_grad_params(graph, solution)
    rules += [_container_rule(m, _param_layouts(graph, solution, fqn), _own(partial, fqn))
              for fqn in _containers(graph) for m in patterned(fqn, graph, pmap)]
    return rules


def buffers(graph: OpGraph, solution: Solution) -> list[LocalBuffers]:
    """The written buffers the solution splits (:mod:`.buffers`), named as the rules are."""
    pmap = pattern_map(graph)
    return buffer_layouts(graph, solution, lambda fqn: patterned(fqn, graph, pmap))


def _own(fqns: list[str], container: str) -> list[str]:
    prefix = f"{container}." if container else ""
    return [f[len(prefix):] for f in fqns if f.startswith(prefix) and "." not in f[len(prefix):]]


def _container_rule(module: str, layouts: dict[str, str], partial: list[str]) -> Rule:
    why = "container that owns parameters directly: Replicate, seen whole by its forward"
    if layouts:
        split = ", ".join(f"{n} {p}" for n, p in layouts.items())
        why = (f"container that owns parameters directly, its forward reading their local shards: {split} "
               "beside the heads it is split with, the rest Replicate")
    if partial:
        why += f"; {', '.join(partial)} whole, its gradient a sum over each rank's shard, all-reduced after backward"
    return Rule(module=module, style="replicate", param_layouts=layouts, partial_grads=partial, why=why)


def _param_layouts(graph: OpGraph, solution: Solution, container: str) -> dict[str, str]:
    """The container's own parameters that the solution shards (read as ``get_attr``)."""
    prefix = f"{container}." if container else ""
    out = {}
    for op in graph.ops:
        name = op.target[len(prefix):] if op.kind == "const" and op.target.startswith(prefix) else ""
        placement = solution.strategies[op.index].output if name and "." not in name else None
        if placement and placement.startswith("S"):
            out[name] = placement_str(placement)
    return out


def _containers(graph: OpGraph) -> list[str]:
    from ..analyze.trace import is_weight_leaf, owns_params

    called = set(graph.module_multiplicity)
    return [
        fqn for fqn, mod in graph.model.named_modules()
        if owns_params(mod) and not is_weight_leaf(mod) and any(not fqn or c.startswith(fqn + ".") for c in called)
    ]


_IN_PLACE = {"iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "copy_", "masked_fill_", "clamp_"}


def _modified_in_place(graph: OpGraph, op) -> bool:
    """Is the module's output the target of an in-place op (Falcon's ``mlp_output += attn``)?
    fx records ``a += b`` on a proxy as ``add``, so the source line tells augmented assignment."""
    for c in graph.consumers.get(op.output, []):
        user = graph.ops[c]
        if user.inputs[:1] != [op.output]:
            continue
        if user.target in _IN_PLACE or (user.target in ("add", "sub", "mul", "truediv") and _AUGMENTED.search(_code(user.node))):
            return True
    return False


_AUGMENTED = re.compile(r"^\s*[\w.\[\]]+\s*[-+*/]=[^=]")


def _code(node) -> str:
    from ..analyze.trace import _user_line

    line = _user_line(node)
    return line.split("`")[1] if line.count("`") >= 2 else ""


def _rule_output(op, s, partial: set[int], returned: set[int]) -> str | None:
    if op.index in partial:
        return "Partial"
    if s.name == "colwise" and op.output in returned:
        return "Shard(-1)"  # vocab-sharded logits handed to the user for loss_parallel()
    return _layout(s.layouts.get("output"))


def _layout(p: str | None) -> str | None:
    return None if p is None else placement_str(p).replace("()", "")


def _why(decision) -> str:
    if decision is None:
        return ""
    parts = []
    for alt in decision.alternatives:
        if alt.step_time_s is None:
            parts.append(f"{alt.style}: {alt.reason or 'infeasible'}")
        else:
            delta = alt.step_time_s - decision.step_time_s
            mem = (alt.param_bytes_per_device or 0) - decision.param_bytes_per_device
            parts.append(f"{alt.style}: {cost.format_seconds(delta)} slower" if delta > 0 and mem <= 0
                         else f"{alt.style}: +{cost.format_bytes(mem)}/device" if mem > 0 else f"{alt.style}: tie")
    return "; ".join(parts)


def _read_as_tensors(graph: OpGraph, fqn: str) -> bool:
    from .propagation import metadata_only

    return any(op.kind == "const" and op.target.rpartition(".")[0] == fqn and op.output is not None
               and any(not metadata_only(graph.ops[c]) for c in graph.consumers.get(op.output, []))
               for op in graph.ops)


def group_norm_attributes(graph: OpGraph, solution: Solution, tp: int) -> list[LocalAttributes]:
    """A weightless ``nn.GroupNorm`` handed whole groups of split channels (``S1``: RetNet's
    norm over heads) normalizes its rank's groups only if it is told how many it holds: with
    the global count it would run, on groups of the wrong width, and no shape would say so.
    Its ``num_groups`` and ``num_channels`` take their local values wherever it is split."""
    pmap = pattern_map(graph)
    found: dict[str, LocalAttributes] = {}
    for op in graph.ops:
        if op.node.op != "call_module" or op.output is None or solution.placements.get(op.output) != "S1":
            continue
        module = graph.model.get_submodule(op.node.target)
        if not isinstance(module, nn.GroupNorm):
            continue
        values = {"num_groups": module.num_groups // tp, "num_channels": module.num_channels // tp}
        why = (f"normalizes groups of channels split tp ways: num_groups {module.num_groups} -> {values['num_groups']}, "
               f"num_channels {module.num_channels} -> {values['num_channels']} on a 1/tp shard")
        for name in patterned(op.node.target, graph, pmap):
            found[name] = LocalAttributes(module=name, values=values, why=why)
    return list(found.values())


def unused_modules(graph: OpGraph) -> list[str]:
    called = set(graph.module_multiplicity) | set(graph.traced.folded)
    above = {c.rsplit(".", k)[0] for c in called for k in range(1, c.count(".") + 1)} | ({""} if called else set())
    out = []
    for fqn, mod in graph.model.named_modules():
        parts = fqn.split(".")
        inside_called = any(".".join(parts[:k]) in called for k in range(1, len(parts) + 1))
        if any(True for _ in mod.parameters(recurse=False)) and not inside_called and fqn not in above:
            out.append(fqn)
    return out


def regions(graph: OpGraph, entries: list[Entry]) -> list[Region]:
    pmap = pattern_map(graph)
    regions = []
    for e in entries:
        if is_slice(e.kind):
            regions += _slice_regions(graph, e, pmap)
            continue
        if is_gather(e.kind):  # Shard(seq) -> Replicate where the module receives it, handed on local
            shard = _layout(e.kind.split(">")[0])
            regions += [Region(module=module, input="output" if site.input is None else site.input,
                               num_inputs=site.num_inputs, input_layouts=shard, desired_input_layouts="Replicate",
                               use_local_output=True,
                               why="its code reads the tokens whole: gathered where it receives them, its gradient sliced back")
                        for site, _ in e.sites for module in patterned(site.module, graph, pmap)]
            continue
        if is_scatter(e.kind) or is_cut(e.kind):  # onto sequence shards where the module returns
            want, at = _layout(scatter_target(e.kind)), exits(graph)[e.value]
            why = ("its partial sums all-reduced where it returns, once for all the branches that add them up"
                   if is_sum(e.kind) else
                   f"its partial sums reduce-scattered onto sequence shards ({want}) where it returns" if is_scatter(e.kind)
                   else f"its whole output cut onto sequence shards ({want}) where it returns, a local slice")
            tokens = flattened_from(graph, e.value, parts_of(scatter_target(e.kind))) if is_scatter(e.kind) else None
            if tokens is not None:  # the module's own [b, s] flattened: Shard(1) of them, whatever b
                want, why = "Shard(1)", why.replace("(Shard(0))", "(Shard(1) of the tokens it flattened)")
            regions += [Region(module=module, input="output", num_inputs=0,
                               input_layouts="Partial" if is_scatter(e.kind) else "Replicate",
                               desired_input_layouts=want, use_local_output=True, tokens_of=tokens,
                               output_index=at.index, num_outputs=at.count if at.index is not None else None, why=why)
                        for site, _ in e.sites for module in patterned(site.module, graph, pmap)]
            continue
        for site, inside in e.sites:
            names = ", ".join(graph.ops[c].target.rpartition(".")[2] for c in inside)
            comm = "all-reduce" if e.kind == "R" else "all-gather/reduce-scatter"
            for module in patterned(site.module, graph, pmap):
                regions.append(Region(
                    module=module, input="output" if site.input is None else site.input,
                    num_inputs=site.num_inputs, input_layouts=_layout(e.kind),
                    desired_input_layouts="Replicate",
                    why=(f"{names} share this input: one {comm} instead of {len(inside)}" if len(inside) > 1 else
                         f"{names} reads it whole: gathered where {site.module.rpartition('.')[2]} receives it, "
                         "so its code sees the whole sequence"),
                ))
    return regions


def _slice_regions(graph: OpGraph, e: Entry, pmap) -> list[Region]:
    """Replicate -> Shard(d) where the module receives the value: each rank's part of it, cut
    locally, handed on as a plain tensor to code that runs on the rank's heads."""
    target = slice_target(e.kind)
    want, blocks = _layout(target), parts_of(target)
    # folded: the value's dim holds ``blocks`` runs (the batch) of ``fold`` rows (the heads);
    # the plan names the run, which the batch size does not change
    fold = graph.values[e.value].shape[shard_dim(target)] // blocks if blocks > 1 else None
    within = f" of every run of {fold} rows" if fold else ""
    if e.value in graph.requires_grad:  # the residual stream, onto sequence shards
        why = (f"the stream its code hands in, cut onto sequence shards ({want}): a local slice, "
               "its gradient all-gathered back")
    else:
        why = f"read beside values split tp ways: each rank cuts its part ({want}{within}), no collective"
    # the first of a folded stack only: the copies receive the block before's output, already cut
    once = received_once(graph, e.value)
    return [Region(module=module, input="output" if site.input is None else site.input, num_inputs=site.num_inputs,
                   input_layouts="Replicate", desired_input_layouts=want, fold=fold, use_local_output=True, why=why)
            for site, _ in e.sites for module in ([site.module] if once else patterned(site.module, graph, pmap))]


def block_regions(graph: OpGraph, blocks: list[PartialBlock]) -> list[Region]:
    pmap = pattern_map(graph)
    out = []
    for b in blocks:
        names = ", ".join(graph.ops[r].target.rpartition(".")[2] for r in b.rowwise)
        for module in patterned(b.module, graph, pmap):
            out.append(Region(module=module, input=b.input, num_inputs=b.num_inputs,
                              why=f"residual enters as a Replicate DTensor so {names} can stay Partial"))
            out.append(Region(module=module, input="output", num_inputs=b.num_inputs, input_layouts="Partial",
                              use_local_output=True,
                              why=f"one all-reduce sums {names} and the residual instead of {len(b.rowwise)}"))
    return out


def repeats(graph: OpGraph) -> dict[str, int | list[str]]:
    out: dict[str, int | list[str]] = {}
    for fqn, mod in graph.model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or not fqn:
            continue
        names = [n for n, _ in mod.named_children()]
        if names:  # an empty one (x-transformers' layer_integrators) repeats nothing
            out[fqn] = len(names) if names == [str(i) for i in range(len(names))] else names
    return out


def merge_repeated(plan_rules: list[Rule], decisions: list, model: nn.Module) -> tuple[list[Rule], list]:
    """Rules that differ only in a block index become one, ``layers.*.attn.wq`` (or an index
    set, ``layers.{0-2,5}...``, where the blocks chose differently). The meta tracer's
    folding writes rules this way already; blocks torch.export traced through (copies it could
    not fold) have one rule per block until this pass. Decisions follow their rules (the first kept)."""
    containers = _containers_of(model)
    renamed: dict[str, str] = {}
    merged: list[Rule] = []
    for key, members in _repeat_groups(plan_rules, containers).items():
        if len(key) == 1 or len(members) == 1:
            merged.append(members[0][1])
            continue
        prefix, suffix = key[0], key[1]
        indices = sorted(i for i, _ in members)
        every = sorted(str(i) for i in indices) == sorted(containers[prefix])
        name = f"{prefix}.{'*' if every else brace_ranges(indices)}{suffix}"
        merged.append(members[0][1].model_copy(update={"module": name}))
        renamed.update({r.module: name for _, r in members})
    kept: dict[str, Any] = {}
    for d in decisions:
        kept.setdefault(renamed.get(d.module, d.module), d.model_copy(update={"module": renamed.get(d.module, d.module)}))
    return merged, list(kept.values())


def merged_representatives(plan_rules: list[Rule], model: nn.Module) -> set[str]:
    """The module of each rule :func:`merge_repeated` keeps (the first of its group): the
    only ones whose decisions survive the merge, so the only ones worth explaining."""
    groups = _repeat_groups(plan_rules, _containers_of(model))
    return {members[0][1].module for members in groups.values()}


def _containers_of(model: nn.Module) -> dict[str, list[str]]:
    return {fqn: [n for n, _ in m.named_children()] for fqn, m in model.named_modules()
            if fqn and isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict))}


def _repeat_groups(plan_rules: list[Rule], containers: dict[str, list[str]]) -> dict[tuple, list[tuple[int, Rule]]]:
    """(container, rest of the name, settings) -> [(index, rule)] in plan order; a rule
    outside any indexed container is a group of its own."""
    groups: dict[tuple, list[tuple[int, Rule]]] = {}
    for rule in plan_rules:
        key = _index_key(rule, containers)
        groups.setdefault(key[:3] if key else (id(rule),), []).append((int(key[3]) if key else -1, rule))
    return groups


def _index_key(rule: Rule, containers: dict[str, list[str]]) -> tuple | None:
    """(container, rest of the name, the rule's settings, index) for ``container.<i>.rest``."""
    parts = rule.module.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if parts[i].isdigit() and prefix in containers:
            rest = "".join(f".{p}" for p in parts[i + 1:])
            settings = rule.model_dump(exclude={"module", "why"})
            return (prefix, rest, repr(sorted(settings.items())), parts[i])
    return None
