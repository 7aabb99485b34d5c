"""Validate: does a plan fit a model? The findings ``shardplan check`` lists.

Contract
--------
``check_findings(plan, model)`` returns one line per problem applying ``plan`` to ``model``
would hit: a fingerprint that differs, a rule or region that matches no module, a module
with parameters no rule covers, a rule whose style cannot split the module it lands on (a
norm, a container without parameters of its own), a split dimension that the tp size does not divide (styles
that gather at once tolerate uneven splits). Empty when the plan fits. ``apply_plan`` warns
with the same lines, so user intent is never silently ignored.
"""

from __future__ import annotations

from typing import Any

from .model import LAYOUT_RE, fingerprint, int_attributes, matches, persistent_buffer

__all__ = ["check_findings", "sharded_dim", "weight_of"]

_COLWISE_STYLES = ("colwise", "colwise_gather_output", "packed_colwise", "colwise_kv_replicated", "colwise_kv_gathered")
_ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "embedding_rowwise")
_KV_STYLES = ("colwise_kv_replicated", "colwise_kv_gathered")
_UNEVEN_OK = ("colwise_gather_output", "embedding_rowwise")


def weight_of(module: Any) -> Any:
    """The module's ``weight`` tensor, else its first own parameter, else ``None``."""
    weight = getattr(module, "weight", None)
    if weight is not None and hasattr(weight, "shape"):
        return weight
    return next(iter(module.parameters(recurse=False)), None)


def sharded_dim(style: str, module: Any) -> int | None:
    """Which dimension of the module's weight ``style`` splits across tp ranks (None: none).

    nn.Linear stores W as [out, in] (colwise splits dim 0, rowwise dim 1); Hugging Face's
    Conv1D stores [in, out], so each style splits the other dim; an Embedding [vocab, dim]
    splits the vocabulary rowwise and the features colwise. Norm styles split nothing, but
    ``norm_sharded``, whose weight goes with the features it normalizes."""
    from ..analyze.graph import module_kind

    kind = module_kind(module)
    if style == "moe_tp_experts" and kind == "experts":
        return _expert_dim(module)
    if style in ("ep_experts", "moe_whole_experts") and kind == "experts":
        return 0  # whole experts, over the ep axis or the tp axis
    if style == "attention_heads" and kind == "attention":
        return 0  # in_proj_weight [3E, E]: each rank's heads of q, k and v
    if style == "norm_sharded":
        return 0  # a norm's weight [features], split with the features it normalizes

    col = {"linear": 0, "conv1d": 1, "embedding": 1}.get(kind)
    row = {"linear": 1, "conv1d": 0, "embedding": 0}.get(kind)
    if style in _COLWISE_STYLES:
        return col
    if style in _ROWWISE_STYLES:
        return row
    return None


def _expert_dim(module: Any) -> int | None:
    """The split dim of the expert bank's parameter :func:`weight_of` shows (its first)."""
    from ..analyze.graph import expert_params

    ep = expert_params(module)
    first = next(name for name, _ in module.named_parameters(recurse=False))
    dims = {ep.up: ep.up_dim, ep.gate: ep.up_dim, ep.down: ep.down_dim, ep.up_bias: 1}
    return dims.get(first)


def _attribute_findings(entry: Any, modules: dict[str, Any]) -> list[str]:
    """An ``attributes`` entry sets integer attributes its modules already have."""
    hits = [fqn for fqn in modules if matches(entry.module, fqn)]
    if not hits:
        return [f"attributes {entry.module}: matches no module of the model"]
    for fqn in hits:
        for name in entry.values:
            have = int_attributes(modules[fqn])
            if name not in have:
                have = sorted(have)
                return [f"attributes {entry.module}: {fqn or '<root>'} ({type(modules[fqn]).__name__}) has no integer "
                        f"attribute {name!r}; its integer attributes are {have}"]
    return []


def _buffer_findings(entry: Any, modules: dict[str, Any], tp: int) -> list[str]:
    """A ``buffers`` entry splits tensors its modules hold (a persistent buffer not in groups),
    on a dim tp, or its group count, divides."""
    import torch  # here: commands that only read plan files do not import torch

    hits = [fqn for fqn in modules if matches(entry.module, fqn)]
    if not hits:
        return [f"buffers {entry.module}: matches no module of the model"]
    for fqn in hits:
        module = modules[fqn]
        for name, layout in entry.layouts.items():
            value = getattr(module, name, None)
            where = f"buffers {entry.module}: {fqn or '<root>'}.{name}"
            if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
                return [f"{where} is not a tensor the module holds (a buffer or a plain attribute)"]
            if name in entry.groups and persistent_buffer(module, name):
                return [f"{where} is in the state dict (a persistent buffer), whose entry cannot hold kv heads in "
                        "groups; drop it from groups (and split it with Shard), or register it with persistent=False"]
            shard = LAYOUT_RE.match(layout)
            dim = int(shard.group(2)) if shard and shard.group(2) is not None else None
            n = entry.groups.get(name, tp)
            if n != tp and tp % n:
                return [f"{where}: groups {n} does not divide tp={tp}; give a group count that divides tp (its kv heads)"]
            if dim is None or not -value.dim() <= dim < value.dim() or value.shape[dim] % n:
                cut = f"tp={tp}" if n == tp else f"its {n} groups"
                return [f"{where} {list(value.shape)}: {layout} needs a dim of it that {cut} divides"]
    return []


def _expert_count_findings(plan: Any, modules: dict[str, Any], at: Any) -> list[str]:
    """An ``ep_experts`` rule's ``num_experts`` is the bank's E, the first dim of every
    parameter of it."""
    for i, rule in enumerate(plan.rules):
        if rule.style != "ep_experts":
            continue
        for fqn in (f for f in modules if matches(rule.module, f)):
            if _expert_list(modules[fqn]):  # a list of expert modules: its length is E
                if len(modules[fqn]) != rule.num_experts:
                    return [f"{at(('rules', i, 'num_experts'))}rule {rule.module} (ep_experts): num_experts "
                            f"{rule.num_experts}, but {fqn} lists {len(modules[fqn])} experts; re-plan it"]
                continue
            sizes = {int(p.shape[0]) for p in modules[fqn].parameters(recurse=False)}
            if sizes != {rule.num_experts}:
                return [f"{at(('rules', i, 'num_experts'))}rule {rule.module} (ep_experts): num_experts "
                        f"{rule.num_experts}, but {fqn}'s parameters have first dims {sorted(sizes)}; re-plan it"]
    return []


def _expert_list(module: Any) -> bool:
    """An ``nn.ModuleList`` of experts: what ``ep_experts`` splits whole when they are modules."""
    from ..analyze.graph import EXPERT_CONTAINERS

    return isinstance(module, EXPERT_CONTAINERS) and len(module) > 1 and any(True for _ in module.parameters())


def _owns_params(module: Any) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _listed_count(module: Any) -> int:
    """The number of head modules of a ``listed_heads`` module (0 for any other)."""
    from ..analyze.trace import listed_heads

    names = listed_heads(module)
    return len(module.get_submodule(names[0])) if names else 0


def _divisibility(rule: Any, hits: list[str], modules: dict[str, Any], tp: int) -> list[str]:
    """A finding when the dim a style splits does not divide by tp (uneven-tolerant styles aside)."""
    if rule.style == "ep_experts":  # over ep, not tp: the plan and _expert_count_findings check it
        return []
    if rule.style in _UNEVEN_OK and not (rule.output_layouts or "").startswith("Shard"):
        return []
    if rule.style in _KV_STYLES and (rule.groups is None or tp % rule.groups or rule.groups >= tp):
        return [f"rule {rule.module} ({rule.style}): groups {rule.groups} must divide tp={tp} and be smaller "
                "(one group per kv head, each on tp / groups ranks); set groups to the number of kv heads"]
    if rule.style == "packed_colwise" and rule.groups is not None and (tp % rule.groups or rule.groups >= tp):
        return [f"rule {rule.module} (packed_colwise): groups {rule.groups} must divide tp={tp} and be smaller "
                "(the kv heads of its whole parts, each gathered over tp / groups ranks); set it to the kv heads"]
    if rule.style == "packed_colwise" and isinstance(rule.packed, list):
        return _unequal_parts(rule, hits, modules, tp)
    parts = rule.groups if rule.style == "colwise_kv_replicated" else tp
    bad = []
    for fqn in hits:
        mod = modules[fqn]
        if rule.style == "attention_heads" and getattr(mod, "num_heads", tp) % tp:
            return [f"{fqn}: attention_heads splits its {mod.num_heads} heads, which tp={tp} does not divide; "
                    "use replicate for it, or a tp that divides its heads"]
        if rule.style == "listed_heads" and (n := _listed_count(mod)) % tp:
            return [f"{fqn}: listed_heads splits its {n} head modules whole, which tp={tp} does not divide; "
                    "use replicate for it, or a tp that divides its heads"]
        weight, dim = weight_of(mod), sharded_dim(rule.style, mod)
        if weight is None or dim is None or dim >= weight.dim() or weight.shape[dim] % parts == 0:
            continue
        bad.append((fqn, dim, int(weight.shape[dim])))
    if not bad:
        return []
    fqn, dim, size = bad[0]
    more = f" (and {len(bad) - 1} more of its modules)" if len(bad) > 1 else ""
    by = f"its groups={parts}" if parts != tp else f"tp={tp}"
    return [f"{fqn}: {rule.style} splits weight dim {dim} of size {size}, which {by} does not divide{more}"]


def _unequal_parts(rule: Any, hits: list[str], modules: dict[str, Any], tp: int) -> list[str]:
    """``packed: [4, 1, 1]``: the output features cut into parts of those relative widths,
    each split tp ways (rank r keeps its slice of every part), so tp must divide every part."""
    for fqn in hits:
        mod = modules[fqn]
        weight, dim = weight_of(mod), sharded_dim(rule.style, mod)
        if weight is None or dim is None or dim >= weight.dim():
            continue
        problem = packed_parts_problem(rule.packed, int(weight.shape[dim]), tp)
        if problem:
            return [f"{fqn}: {problem}"]
    return []


def part_rows(parts: list[int] | tuple[int, ...], size: int) -> list[int] | None:
    """The rows of each part of a dim of ``size`` cut in relative widths ``parts``; ``None``
    when ``size`` is not a whole multiple of their sum."""
    total = sum(parts)
    if total <= 0 or size % total:
        return None
    return [p * (size // total) for p in parts]


def packed_parts_problem(parts: list[int] | tuple[int, ...], size: int, tp: int) -> str | None:
    """What keeps ``size`` output features from being cut into ``parts`` each split tp ways
    (the plan check and the style at apply time say the same); None when nothing does."""
    rows = part_rows(parts, size)
    if rows is None:
        return (f"packed {list(parts)} does not fit its {size} output features ({size} is not a multiple of "
                f"{sum(parts)}); give each part's width, in rows or relative, so they sum to a divisor of {size}")
    if any(r % tp for r in rows):
        return (f"packed {list(parts)} cuts its {size} output features into parts of {rows} rows, which tp={tp} does "
                "not divide; each rank keeps 1/tp of every part, so use a tp that divides every part (the heads of "
                "each), or plan it colwise_gather_output")
    return None


# which kinds of module (analyze.graph.module_kind) each style can split; the rest need
# no weight kind (replicate takes anything; sequence parallel takes norms and the like)
_KINDS = {
    "colwise": {"linear", "conv1d", "embedding"}, "colwise_gather_output": {"linear", "conv1d", "embedding"},
    "packed_colwise": {"linear", "conv1d"}, "colwise_kv_replicated": {"linear"}, "colwise_kv_gathered": {"linear"}, "rowwise": {"linear", "conv1d", "embedding"},
    "rowwise_split_input": {"linear", "conv1d"}, "embedding_rowwise": {"embedding"}, "moe_tp_experts": {"experts"},
    "ep_experts": {"experts"}, "moe_whole_experts": {"experts"},
    "attention_heads": {"attention"},
    "dtensor_weights": {"other"},
    "listed_heads": {"listed_heads"},
}


def _wrong_kind(rule: Any, hits: list[str], modules: dict[str, Any]) -> list[str]:
    """A finding when a rule lands on a module its style cannot split, or on one that owns
    no parameters (a container: the style would act on its whole call)."""
    from ..analyze.graph import module_kind

    kinds = _KINDS.get(rule.style)
    bad = []
    for fqn in hits:
        mod = modules[fqn]
        if rule.style == "ep_experts" and _expert_list(mod):
            continue
        if rule.style == "listed_heads" and module_kind(mod) != "listed_heads":
            bad.append(f"{fqn or '<root>'} ({type(mod).__name__}) is no list of head modules and a projection")
        elif rule.style == "listed_heads":
            continue
        elif not _owns_params(mod) and rule.style != "replicate":
            bad.append(f"{fqn or '<root>'} ({type(mod).__name__}) owns no parameters")
        elif kinds is not None and _owns_params(mod) and module_kind(mod) not in kinds:
            bad.append(f"{fqn or '<root>'} is a {type(mod).__name__} ({module_kind(mod)}), which {rule.style} cannot split")
    if not bad:
        return []
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return [f"rule {rule.module} ({rule.style}): {bad[0]}{more}; narrow the pattern to the modules it fits"]


def check_findings(plan: Any, model: Any, *, where: Any = None) -> list[str]:
    """Problems applying ``plan`` to ``model`` would hit; empty when it fits. ``where(key_path)``
    prefixes a finding with the file and line of that key (``shardplan check`` passes one)."""
    at = where or (lambda _key: "")
    findings = []
    got = fingerprint(model)
    if got != plan.model.fingerprint:
        findings.append(f"{at(('model', 'fingerprint'))}fingerprint: the plan is for a {plan.model.class_name} with "
                        f"{plan.model.fingerprint}, the model is a {type(model).__name__} with {got}; "
                        "re-plan it with `shardplan plan`")
    modules = dict(model.named_modules())
    findings += _rule_findings(plan, modules, at)
    findings += _expert_count_findings(plan, modules, at)
    for i, region in enumerate(plan.regions):
        if not any(matches(region.module, fqn) for fqn in modules):
            findings.append(f"{at(('regions', i, 'module'))}region {region.module}: matches no module of the model")
    for i, entry in enumerate(plan.attributes):
        findings += [at(("attributes", i, "module")) + f for f in _attribute_findings(entry, modules)]
    for i, entry in enumerate(plan.buffers):
        findings += [at(("buffers", i, "module")) + f for f in _buffer_findings(entry, modules, plan.tp)]
    for i, entry in enumerate(plan.local_views):
        if not any(matches(entry.module, fqn) for fqn in modules):
            findings.append(f"{at(('local_views', i, 'module'))}local_views {entry.module}: matches no module of the model")
    covered = {fqn for rule in {r.module for r in plan.rules} for fqn in modules if matches(rule, fqn)}
    whole = {fqn for r in plan.rules if r.style == "dtensor_weights" for fqn in modules if matches(r.module, fqn)}
    covered |= _read_by_their_parent(covered, modules, whole)
    for fqn, mod in modules.items():
        if _owns_params(mod) and fqn not in covered:
            findings.append(f"{fqn or '<root>'} ({type(mod).__name__}): owns parameters but no rule covers it")
    return findings


def _read_by_their_parent(covered: set[str], modules: dict[str, Any], dtensor_weights: set[str]) -> set[str]:
    """Children whose parameters their parent's call reads itself (``nn.MultiheadAttention``'s
    ``out_proj``; the norms inside a ``dtensor_weights`` module; the router inside an expert
    bank): the parent is one op of the graph, and its rule covers them."""
    from ..analyze.trace import is_weight_leaf

    parents = [fqn for fqn in covered if is_weight_leaf(modules[fqn]) or fqn in dtensor_weights]
    return {f"{p}.{name}" for p in parents for name, _ in modules[p].named_modules() if name}


_MAX_REPEATS_LISTED = 20


def _rule_findings(plan: Any, modules: dict[str, Any], at: Any) -> list[str]:
    """Each distinct rule is judged once (a file of a million copies of one rule is checked
    in the time of one); a module pattern given twice is a finding, since the last wins."""
    findings, verdicts, first, repeats = [], {}, {}, 0
    for i, rule in enumerate(plan.rules):
        if rule.module in first:
            repeats += 1
            if repeats <= _MAX_REPEATS_LISTED:
                findings.append(f"{at(('rules', i, 'module'))}rule {rule.module} ({rule.style}): the module pattern of "
                                f"rule {first[rule.module]} again; the last one given wins: keep one")
            continue
        first[rule.module] = i
        key = (rule.module, rule.style, rule.output_layouts, tuple(sorted(rule.param_layouts.items())))
        if key not in verdicts:
            verdicts[key] = _judge(rule, modules, plan.tp)
        findings += [at(("rules", i, field)) + f for field, f in verdicts[key]]
    if repeats > _MAX_REPEATS_LISTED:
        findings.append(f"... and {repeats - _MAX_REPEATS_LISTED} more rules that repeat a module pattern")
    return findings


def _judge(rule: Any, modules: dict[str, Any], tp: int) -> list[tuple[str, str]]:
    hits = [fqn for fqn in modules if matches(rule.module, fqn)]
    if not hits:
        return [("module", f"rule {rule.module} ({rule.style}): matches no module of the model")]
    return ([("module", f) for f in _wrong_kind(rule, hits, modules)]
            + [("style", f) for f in _divisibility(rule, hits, modules, tp)]
            + [("param_layouts", f) for f in _param_layout_findings(rule, hits, modules, tp)])


def _param_layout_findings(rule: Any, hits: list[str], modules: dict[str, Any], tp: int) -> list[str]:
    """``param_layouts`` names the module's own parameters (``dtensor_weights``: its norm
    children's too, ``q_norm.weight``), each Shard(d) on a dim tp divides."""
    out = []
    for name, layout in rule.param_layouts.items():
        for fqn in hits:
            owned = dict(modules[fqn].named_parameters(recurse=rule.style == "dtensor_weights"))
            p = owned.get(name)
            dim = int(layout[6:-1]) if layout.startswith("Shard(") else None
            if p is None:
                out.append(f"rule {rule.module}: param_layouts names {name!r}, which {fqn or '<root>'} does not own; "
                           f"use one of {sorted(owned)}")
            elif dim is not None and (not -p.dim() <= dim < p.dim() or p.shape[dim] % tp):
                out.append(f"rule {rule.module}: {name} {layout} needs a dim of its shape {list(p.shape)} that tp={tp} divides")
            else:
                continue
            break
    return out
