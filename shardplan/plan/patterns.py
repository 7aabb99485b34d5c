"""Module patterns: how a plan's rule names modules.

Contract
--------
A pattern is a dotted module name whose segments are ``fnmatch`` patterns, as
``parallelize_module`` resolves plan keys (``layers.*.attn``), or ``{a-b,c}`` index sets (a
stack of several kinds of block writes one rule per kind). ``matches`` tests one name,
``expand_pattern`` lists the names through the container sizes a plan records, and
``expand_braces``/``brace_members``/``brace_ranges`` read and write the index sets.
"""

from __future__ import annotations

import fnmatch
import re

__all__ = ["brace_members", "brace_ranges", "expand_braces", "matches", "expand_pattern"]


_BRACES = re.compile(r"^\{(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\}$")


def brace_members(part: str) -> list[str] | None:
    """``{0-2,5}`` -> ``['0', '1', '2', '5']``: the layer indices a folded rule stands for
    (a stack of several kinds of block writes one rule per kind); ``None`` for any other part."""
    m = _BRACES.match(part)
    if not m:
        return None
    out: list[str] = []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        out += [str(i) for i in range(int(lo), int(hi or lo) + 1)]
    return out


def brace_ranges(indices: list[int]) -> str:
    """The inverse: ``[0, 1, 2, 5]`` -> ``{0-2,5}``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "{" + ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) + "}"


def expand_braces(pattern: str) -> list[str]:
    """Every pattern a ``{...}`` segment stands for, other segments kept (``*`` included)."""
    out = [""]
    for part in pattern.split("."):
        members = brace_members(part) or [part]
        out = [f"{o}.{m}" if o else m for o in out for m in members]
    return out if pattern else [""]


def matches(pattern: str, fqn: str) -> bool:
    """Segment-wise fnmatch, as ``parallelize_module`` resolves plan keys, plus ``{a-b,c}``
    index sets."""
    ps, fs = pattern.split("."), fqn.split(".")
    return len(ps) == len(fs) and all(_segment(p, f) for p, f in zip(ps, fs))


def _segment(part: str, name: str) -> bool:
    members = brace_members(part)
    return name in members if members is not None else fnmatch.fnmatchcase(name, part)


def expand_pattern(pattern: str, repeats: dict[str, int | list[str]]) -> list[str]:
    """Expand ``*`` segments through the container sizes recorded in ``repeats``, and
    ``{a-b,c}`` segments to their indices."""
    return [fqn for expanded in expand_braces(pattern) for fqn in _expand_stars(expanded, repeats)]


def _expand_stars(pattern: str, repeats: dict[str, int | list[str]]) -> list[str]:
    parts = pattern.split(".")
    prefixes = [""]
    for part in parts:
        nxt = []
        for prefix in prefixes:
            if any(ch in part for ch in "*?["):
                names = repeats.get(prefix, [])
                names = [str(i) for i in range(names)] if isinstance(names, int) else names
                nxt += [f"{prefix}.{n}" if prefix else n for n in names if fnmatch.fnmatchcase(n, part)]
            else:
                nxt.append(f"{prefix}.{part}" if prefix else part)
        prefixes = nxt
    return prefixes
