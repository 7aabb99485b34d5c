"""Runs the bad-input table (cases.py): right exit status or exception, a message that names
the offending value (and file:line), no traceback, and an answer within the row's bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import shardplan
from shardplan.cli import main

from .cases import BASES, CASES, DIR, Case, Edit

_LINE = re.compile(r"\{line:(.+?)\}")
_ERROR = re.compile(r"^shardplan: error: ", re.M)


class Fixtures:
    """Valid plans to edit or apply, each written once per session by ``shardplan plan -o``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._texts: dict[str, str] = {}
        self._plans: dict[str, Any] = {}

    def text(self, name: str) -> str:
        if name not in self._texts:
            path = self.root / f"{name}.yaml"
            code = main([*BASES[name], "-o", str(path), "--force"])
            assert code == 0, f"could not write the {name} base plan ({BASES[name]})"
            self._texts[name] = path.read_text()
        return self._texts[name]

    def plan(self, name: str) -> Any:
        if name not in self._plans:
            self._plans[name] = shardplan.Plan.from_yaml(self.text(name))
        return self._plans[name]


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    return Fixtures(tmp_path_factory.mktemp("bad_inputs_bases"))


def _params() -> list[Any]:
    ids = [c.id for c in CASES]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"duplicate case ids: {dupes}"
    out = []
    for case in CASES:
        marks = [pytest.mark.timeout(case.timeout)]
        if case.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=case.xfail))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def _write_files(case: Case, root: Path, fx: Fixtures) -> dict[str, str]:
    """Create the row's files; returns the text of each (for ``{line:...}``)."""
    texts = {}
    for name, content in case.files.items():
        path = root / name
        if content is DIR:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Edit):
            content = content.apply(fx.text(content.base))
        if isinstance(content, bytes):
            path.write_bytes(content)
            texts[name] = content.decode("utf-8", "replace")
        else:
            path.write_text(content)
            texts[name] = content
    return texts


def _resolve(pattern: str | None, texts: dict[str, str]) -> str | None:
    """``{line:REGEX}`` -> the number of the first line of the row's files that REGEX matches."""
    if pattern is None:
        return None

    def line_of(m: re.Match) -> str:
        needle = re.compile(m.group(1))
        for text in texts.values():
            for i, line in enumerate(text.splitlines(), 1):
                if needle.search(line):
                    return str(i)
        raise AssertionError(f"case pattern {m.group(0)}: no line of the case's files matches")

    return _LINE.sub(line_of, pattern)


def _check_cli_output(case: Case, code: int, out: str, err: str, elapsed: float, texts: dict[str, str]) -> None:
    shown = f"\n--- exit {code}\n--- stdout:\n{out[-2000:]}\n--- stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, "a traceback on stderr" + shown
    assert "internal error" not in err, "reported as an internal error" + shown
    assert code == case.code, f"exit status {code}, expected {case.code}" + shown
    match = _resolve(case.match, texts)
    assert re.search(match, err, re.M), f"stderr does not match {match!r}" + shown
    if case.out is not None:
        want = _resolve(case.out, texts)
        assert re.search(want, out, re.M), f"stdout does not match {want!r}" + shown
    if code == 2 and not err.lstrip().startswith("usage:"):
        errors = _ERROR.findall(err)
        assert len(errors) == 1, "expected one 'shardplan: error:' line" + shown
        lines = err[_ERROR.search(err).start():].strip().splitlines()
        assert len(lines) <= 2, "the error takes more than two lines" + shown
    if code == 1:
        assert not _ERROR.search(err), "findings reported as an error" + shown
    assert elapsed < case.bound, f"answered in {elapsed:.2f} s, bound {case.bound} s" + shown


def _run_cli(case: Case, capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str, float]:
    capfd.readouterr()  # drop what writing the fixtures printed
    start = time.perf_counter()
    try:
        code = main(list(case.argv))
    except BaseException as exc:  # noqa: BLE001 - main must return, never raise
        if isinstance(exc, KeyboardInterrupt):
            raise
        pytest.fail(f"main({list(case.argv)}) raised {type(exc).__name__}: {exc} instead of returning an exit status")
    elapsed = time.perf_counter() - start
    out, err = capfd.readouterr()
    return code, out, err, elapsed


def _run_proc(case: Case, cwd: Path) -> tuple[int, str, str, float]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    env.pop("SHARDPLAN_TRACEBACK", None)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "shardplan", *case.argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=case.bound + 20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m shardplan {' '.join(case.argv)}: no answer within {case.bound + 20} s")
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - start


def _run_api(case: Case, fx: Fixtures, capfd: pytest.CaptureFixture[str], texts: dict[str, str]) -> None:
    capfd.readouterr()
    start = time.perf_counter()
    caught: BaseException | None = None
    try:
        result = case.call(fx)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the row says which kind it must be
        caught = exc
    elapsed = time.perf_counter() - start
    _, err = capfd.readouterr()
    assert caught is not None, f"no error: returned {type(result).__name__}, expected {case.exc.__name__}"
    msg = str(caught)
    shown = f"\n--- raised {type(caught).__module__}.{type(caught).__name__}: {msg[:2000]}"
    assert isinstance(caught, case.exc), f"expected {case.exc.__name__}" + shown
    assert "internal error" not in msg, shown
    assert "Traceback" not in err, f"a traceback on stderr:\n{err[-3000:]}"
    match = _resolve(case.match, texts)
    assert re.search(match, msg, re.M), f"the message does not match {match!r}" + shown
    assert elapsed < case.bound, f"raised after {elapsed:.2f} s, bound {case.bound} s" + shown


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Case, fixtures: Fixtures, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SHARDPLAN_TRACEBACK", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the working directory on it
    texts = _write_files(case, tmp_path, fixtures)
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)
    try:
        if case.kind == "api":
            _run_api(case, fixtures, capfd, texts)
            return
        run = _run_proc(case, tmp_path) if case.kind == "proc" else _run_cli(case, capfd)
        _check_cli_output(case, *run, texts)
    finally:  # forget the row's own modules (bi_builders, ...): the next row writes its own
        for name in set(sys.modules) - before:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if path.startswith(str(tmp_path)):
                del sys.modules[name]


def test_the_table_is_big_enough() -> None:
    kinds = {k: sum(c.kind == k for c in CASES) for k in ("cli", "proc", "api")}
    assert len(CASES) >= 60 and all(kinds.values()), kinds
