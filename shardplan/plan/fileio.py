"""Plan files as text: one strict YAML parse, line-aware error messages, atomic writes.

Contract
--------
``load_mapping(text, source=...)`` parses YAML once (libyaml's C loader where installed,
``safe`` construction only, so a plan file never runs code) and returns the top-level
mapping and a map from each key path (``("rules", 3, "style")``) to its 1-based line.
It refuses, as :class:`PlanFileError` naming the file and line: invalid YAML, anything
but a mapping at the top, a key given twice in one mapping (both lines named), YAML
anchors and aliases (a plan file is a plain tree; an alias is how a "billion laughs" file
explodes in memory), and nesting deeper than :data:`MAX_DEPTH`.
``describe(exc, lines, source)`` turns a pydantic ``ValidationError`` into messages that
name the file:line, the key, the value given and what is allowed. ``atomic_write``
writes through a temporary file and ``os.replace`` so a crash never leaves half a plan,
and refuses to overwrite unless ``force``. Nothing here knows the plan's schema: the data
model (:mod:`shardplan.plan.model`) validates.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

__all__ = ["PlanFileError", "load_mapping", "read_text", "describe", "atomic_write", "MAX_DEPTH"]

MAX_DEPTH = 32  # a plan file nests 5 deep; anything far deeper is not a plan
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BRACKETS = re.compile(r"[\[\]{}]")
_DEEP_INDENT = re.compile(r"^ {%d}" % (8 * MAX_DEPTH), re.M)
_DEEP_DASHES = re.compile(r"(?:- +){%d}" % (4 * MAX_DEPTH))  # `- - - ... x`: sequences nested on one line
# the only tags a plan file's values take; the others (!!python/..., !!set, !!timestamp,
# the << merge key, custom !tags) are refused before anything is constructed
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}
_MAX_ERRORS = 5


class PlanFileError(ValueError):
    """A plan file that cannot be used; the message names the file, the key and what to do."""


def _too_deep(text: str) -> int | None:
    """The line where flow brackets or indentation nest far past any plan file, checked
    before libyaml parses (deep enough nesting crashes its recursive parser)."""
    depth = 0
    for m in _BRACKETS.finditer(text):
        depth += 1 if m.group() in "[{" else -1
        if depth > 4 * MAX_DEPTH:
            return text.count("\n", 0, m.start()) + 1
    deep = _DEEP_INDENT.search(text) or _DEEP_DASHES.search(text)
    return None if deep is None else text.count("\n", 0, deep.start()) + 1


def _compose(text: str, source: str) -> yaml.Node | None:
    deep = _too_deep(text)
    if deep is not None:
        raise PlanFileError(f"{source}:{deep}: nested deeper than a plan file can be (at most {MAX_DEPTH} levels)")
    try:
        return yaml.compose(text, Loader=_LOADER)
    except UnicodeError:
        raise PlanFileError(f"{source}:{_first_surrogate_line(text)}: holds characters that are not valid UTF-8 text (a lone surrogate); "
                            "a plan file is YAML text written by `shardplan plan -o`") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ":1"
        problem = str(getattr(exc, "problem", exc))
        if "nesting depth" in problem:  # libyaml 0.2.5+ stops there itself
            raise PlanFileError(f"{source}{where}: nested deeper than a plan file can be (at most {MAX_DEPTH} levels)") from None
        raise PlanFileError(f"{source}{where}: not valid YAML ({problem}); fix the syntax") from None
    except RecursionError:
        raise PlanFileError(f"{source}:1: nested deeper than a plan file can be (at most {MAX_DEPTH} levels)") from None


def _first_surrogate_line(text: str) -> int:
    at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), 0)
    return text.count("\n", 0, at) + 1


def _walk(root: yaml.Node, source: str) -> dict[tuple, int]:
    """Key path -> line, visiting each node once, in document order (breadth first, with a
    queue: no recursion limit to hit, and an alias is met first where it is first used)."""
    lines: dict[tuple, int] = {}
    seen: set[int] = set()
    queue: deque[tuple[yaml.Node, tuple]] = deque([(root, ())])
    while queue:
        node, path = queue.popleft()
        if id(node) in seen:  # the composer hands an alias back as its anchor's node
            raise PlanFileError(f"{source}:{lines.get(path, lines.get(path[:-1], 1))}: {_key(path)}: YAML aliases "
                                "(*name) are not allowed in plan files; write the value out")
        seen.add(id(node))
        if len(path) > MAX_DEPTH:
            raise PlanFileError(f"{source}:{node.start_mark.line + 1}: nested deeper than a plan file can be "
                                f"(at most {MAX_DEPTH} levels)")
        lines.setdefault(path, node.start_mark.line + 1)
        if node.tag not in _PLAIN_TAGS:
            raise PlanFileError(f"{source}:{node.start_mark.line + 1}: {_key(path)}: YAML tag {node.tag.split(':')[-1]!r} is "
                                "not allowed in plan files; write a plain string, number, list or mapping")
        if isinstance(node, yaml.MappingNode):
            queue.extend(_mapping_children(node, path, lines, source))
        elif isinstance(node, yaml.SequenceNode):
            queue.extend((v, path + (i,)) for i, v in enumerate(node.value))
    return lines


def _mapping_children(node: yaml.MappingNode, path: tuple, lines: dict[tuple, int], source: str) -> list:
    first: dict[Any, int] = {}
    children = []
    for k, v in node.value:
        line = k.start_mark.line + 1
        if not isinstance(k, yaml.ScalarNode) or k.tag not in _PLAIN_TAGS:
            raise PlanFileError(f"{source}:{line}: {_key(path)}: a key must be a plain name, got "
                                f"{'a ' + type(k).__name__.replace('Node', '').lower() if not isinstance(k, yaml.ScalarNode) else repr(k.value)}")
        name = k.value
        if name in first:
            raise PlanFileError(f"{source}:{line}: {_key(path + (name,))}: key given twice (lines {first[name]} and "
                                f"{line}); keep one")
        first[name] = line
        lines[path + (name,)] = line
        children.append((v, path + (name,)))
    return children


def load_mapping(text: str, *, source: str = "<string>") -> tuple[dict, dict[tuple, int]]:
    root = _compose(text, source)
    if not isinstance(root, yaml.MappingNode):
        got = "nothing" if root is None else type(root).__name__.replace("Node", "").lower()
        line = root.start_mark.line + 1 if root is not None else 1
        raise PlanFileError(f"{source}:{line}: a plan file is a YAML mapping with 'version', 'mesh', 'rules'; got {got}")
    lines = _walk(root, source)
    try:
        return SafeConstructor().construct_document(root), lines
    except (yaml.YAMLError, ValueError, KeyError, TypeError, OverflowError) as exc:  # e.g. `!!int abc`
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ":1"
        raise PlanFileError(f"{source}{where}: a value cannot be read ({type(exc).__name__}: "
                            f"{str(getattr(exc, 'problem', None) or exc)[:120]}); write plain values") from None


def read_text(path: Path) -> str:
    """A plan file's text; an unreadable or non-UTF-8 file is a :class:`PlanFileError` naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise PlanFileError(f"{path}: not a UTF-8 text file (byte {exc.start} is 0x{exc.object[exc.start]:02x}); "
                            "a plan file is YAML text written by `shardplan plan -o`") from None


def _key(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<top>"


def _nearest_line(loc: tuple, lines: dict[tuple, int]) -> int:
    for k in range(len(loc), -1, -1):
        if loc[:k] in lines:
            return lines[loc[:k]]
    return 1


def _given(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: dict, *, listed: bool) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key: remove it or check its spelling against `shardplan schema`"
    if kind == "missing":
        return "this key is required"
    given = _given(err.get("input"))
    if kind == "literal_error":
        if listed:
            return f"{given} is not allowed (allowed values as above)"
        return f"{given} is not allowed; expected one of {err.get('ctx', {}).get('expected', '')} (see docs/plan-format.md)"
    return err["msg"] if given in err["msg"] else f"{err['msg']}; got {given}"


def describe(exc: Any, lines: dict[tuple, int], source: str) -> str:
    """One line per pydantic error: ``file:line: key: what was given and what is allowed``."""
    msgs, listed = [], False
    errors = exc.errors()
    for err in errors[:_MAX_ERRORS]:
        loc = tuple(err["loc"])
        msgs.append(f"{source}:{_nearest_line(loc, lines)}: {_key(loc)}: {_message(err, listed=listed)}")
        listed = listed or err.get("type") == "literal_error"
    more = len(errors) - _MAX_ERRORS
    return "\n".join(msgs) + (f"\n... and {more} more" if more > 0 else "")


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
