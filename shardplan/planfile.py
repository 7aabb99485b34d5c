"""Plan files: strict, line-aware loading and atomic writing of plan YAML.

Contract
--------
``parse_plan_text(text, source=...)`` turns YAML text into a :class:`~shardplan.plan.Plan`
using ``yaml.safe_load`` only. Any problem (bad YAML, an unknown key, a bad style name or
layout, a wrong version) raises :class:`~shardplan.plan.PlanFileError` whose message names
the file, the line, the key and what to do. ``atomic_write`` writes through a temporary
file and ``os.replace`` so a crash never leaves half a plan, and refuses to overwrite
unless ``force``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .plan import Plan, PlanFileError

__all__ = ["parse_plan_text", "atomic_write", "key_lines"]


def key_lines(text: str) -> dict[tuple, int]:
    """Map each key path (e.g. ``("rules", 3, "style")``) to its 1-based line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                lines[path + (k.value,)] = k.start_mark.line + 1
                walk(v, path + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def parse_plan_text(text: str, *, source: str = "<string>") -> Plan:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise PlanFileError(f"{source}{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix the syntax") from exc
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: a plan file is a YAML mapping with 'version', 'mesh', 'rules'; got {type(data).__name__}")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanFileError(_describe(exc, key_lines(text), source)) from None


def _describe(exc: ValidationError, lines: dict[tuple, int], source: str) -> str:
    msgs = []
    for n, err in enumerate(exc.errors()[:5]):
        loc = tuple(err["loc"])
        line = _nearest_line(loc, lines)
        key = ".".join(str(p) for p in loc) or "<top>"
        hint = _hint(err)
        msg = err["msg"]
        if err.get("type") == "literal_error" and n:  # the allowed values were listed once already
            msg, hint = f"{err.get('input')!r} is not allowed", ""
        msgs.append(f"{source}:{line}: {key}: {msg}" + (f" ({hint})" if hint else ""))
    more = len(exc.errors()) - 5
    return "\n".join(msgs) + (f"\n... and {more} more" if more > 0 else "")


def _nearest_line(loc: tuple, lines: dict[tuple, int]) -> int:
    for k in range(len(loc), -1, -1):
        if loc[:k] in lines:
            return lines[loc[:k]]
    return 1


def _hint(err: dict) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key: remove it or check its spelling against `shardplan schema`"
    if kind == "literal_error":
        return "see docs/plan-format.md for the allowed values"
    if kind == "missing":
        return "this key is required"
    return ""


def atomic_write(path: Path, text: str, *, force: bool = False) -> None:
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force (or force=True) to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a plan file is for the team
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
