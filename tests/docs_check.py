"""Run the console examples of README.md and docs/*.md and compare them with real output.

    python -m tests.docs_check                 # check every block; exit 1 on a difference
    python -m tests.docs_check --update        # rewrite the expected outputs from real runs
    python -m tests.docs_check docs/cli.md:216 # only the block that starts at that line
    python -m tests.docs_check --skip-slow -j 2

``tests/test_docs.py`` runs the same checks under pytest, one test per block.

Conventions
-----------
Blocks.
    Every fenced block opened with ```console is a terminal transcript, and so is a
    ```text block whose first line starts with ``$ `` (README.md's "What you get"). Other
    blocks (``python``, ``bash``, ``yaml``, bare ```) are not run.

Commands and expected output.
    A line starting with ``$ `` is a command. It goes on over the next lines while bash
    says it is incomplete (an open quote, a trailing backslash), so a ``python -c "..."``
    over several lines is one command. The lines after a command, up to the next ``$ ``
    line or the end of the block, are its expected output: stdout and stderr merged in the
    order a terminal shows them (Python runs unbuffered).

``...``
    A line that is exactly ``...`` (after stripping trailing whitespace) in the expected
    output matches any run of lines, none included. Elisions inside a line are not
    supported: elide whole lines.

Normalisation, applied before comparing (and nothing else is normalised: memory, step
times, collective counts and bytes, fingerprints must match exactly):
    * trailing whitespace on every line, trailing blank lines of each output, ``\\r\\n``;
    * the block's temporary directory in the real output is written ``<tmp>``, and the
      repository root ``<repo>``;
    * wall-clock timings: ``<N.N> s on the ranks`` (``shardplan verify``) on both sides;
    * measured float differences written ``d.dde-dd`` (verify's ``max |tp - ref|``): they
      move in the last bits with the machine's BLAS kernel (``OPENBLAS_CORETYPE``).

How a block runs.
    Each block gets a fresh temporary directory as its working directory; its commands run
    there one after another, each in its own ``bash -c`` (files carry over from one command
    to the next, shell variables and ``cd`` do not; ``$?`` is the exit status of the
    previous command). A non-zero exit status is not a failure by itself; show it with
    ``$ echo $?`` where it matters. Before the block runs, every ```python block of the
    docs whose first line is exactly ``# NAME.py`` (``tp_demo.py``, ``auto_demo.py`` in
    docs/getting-started.md) is written into that directory as ``NAME.py``, as a reader who
    saved those files would have them, so ``tp_demo:Net`` and ``python tp_demo.py`` work.
    The directory also starts with a copy of the repository's ``plans/`` (the checked-in
    plan files) and ``examples/``, so a command written for the repository root (``shardplan check
    plans/llama3-8b.tp8.yaml llama3-8b``) runs as it does there, and writing into it
    (``-o plans/... --force``) never touches the repository. Blocks with exactly the same
    commands run once and share the result (their directories start the same, and the
    output is deterministic, which is what the docs claim).

    Environment: ``PYTHONPATH`` is the repository root only, so ``python -m shardplan``
    is this tree's package; ``python`` is the interpreter running the check and
    ``shardplan`` runs ``python -m shardplan``; ``NO_COLOR=1``, ``TERM=dumb``,
    ``OMP_WAIT_POLICY=PASSIVE``, ``HF_HUB_OFFLINE=1``, ``PYTHONUNBUFFERED=1``,
    ``PYTHONIOENCODING=utf-8``. ``COLUMNS`` and ``LINES`` are removed: output goes to a
    pipe, so argparse wraps help at 80 columns and shardplan's tables are 120 wide,
    exactly what a reader gets from ``shardplan ... | less`` or in a log.

Speed.
    Most of a ``python -m shardplan`` run is importing torch. A plain ``python -m shardplan
    ARGS`` or ``shardplan ARGS`` command (words without quotes, globs or shell syntax) is
    therefore run by forking a warm interpreter that has imported ``torch`` and
    ``shardplan`` and nothing else, in the block's directory with the same environment,
    ``sys.argv`` and ``sys.path[0]`` as a fresh ``python -m shardplan`` (``runpy``, exactly
    as ``-m`` does). Everything else (pipes, ``$?``, ``python -c``, ``python tp_demo.py``)
    goes through bash. ``--fresh`` (or ``DOCS_CHECK_FRESH=1``) runs every command as a new
    process instead; use it to confirm that the two agree.

Directives: an HTML comment on the line just before the opening fence, items separated by
commas (``<!-- docs-check: slow, requires transformers -->``).
    ``skip (reason)``     the block is not run (keep these rare);
    ``slow``              it takes more than ~10 s; it is run, but ``--skip-slow`` (or
                          ``DOCS_CHECK_SKIP_SLOW=1`` under pytest) skips it;
    ``requires MODULE``   skipped when ``MODULE`` cannot be imported (optional extras such as
                          ``transformers``).

``--update`` reruns every block and rewrites, in place, the expected output of each command
whose output no longer matches; commands that match are left as written (their ``...``
elisions and timings included). Where a changed output had ``...`` lines, they are kept
where they still fit. Review the result with ``git diff``: the new text is whatever the
code printed.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import difflib
import functools
import importlib
import importlib.util
import json
import os
import re
import runpy
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "REPO", "Block", "Command", "CommandResult", "BlockResult", "Runner", "doc_files", "parse_file",
    "collect_blocks", "skip_reason", "example_files", "command_env", "run_block", "run_blocks",
    "default_jobs", "matches", "normalise_output", "updated_expected", "update_files", "main",
]

REPO = Path(__file__).resolve().parent.parent
ELLIPSIS = "..."
TMP_TOKEN = "<tmp>"
REPO_TOKEN = "<repo>"
COMMAND_TIMEOUT_S = 600.0
COPIED_DIRS = ("plans", "examples")  # copied from the repository root into each block's directory

_FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
_DIRECTIVE_RE = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")
_ITEM_RE = re.compile(r"(skip)\s*(?:\((.*)\))?|(slow)|requires\s+([A-Za-z_][\w.]*)")
_EXAMPLE_FILE_RE = re.compile(r"^#\s+([A-Za-z_][A-Za-z0-9_]*\.py)\s*$")
# wall-clock timings that legitimately differ between runs: (pattern, replacement)
_TIMINGS = (
    (re.compile(r"\b\d+(?:\.\d+)? s on the ranks\b"), "<seconds> s on the ranks"),
    # a measured difference between float runs (verify's |tp - ref|) moves in its last
    # bits with the machine's BLAS kernel; its tolerance (1e-05, no mantissa dot) does not
    (re.compile(r"\b\d\.\d+e[-+]\d\d\b"), "<float>"),
)
# environment variables that would change widths, colours or tracebacks
_DROP_ENV = ("COLUMNS", "LINES", "JUPYTER_COLUMNS", "JUPYTER_LINES", "FORCE_COLOR", "CLICOLOR_FORCE",
             "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONWARNINGS",
             "SHARDPLAN_TRACEBACK", "PYTHONBREAKPOINT")


# --------------------------------------------------------------------------- parsing


@dataclass
class Command:
    """One ``$ `` command of a block and the output the doc shows for it."""

    line: int                  # 1-based line of the ``$ `` line
    text: str                  # the command, without ``$ ``, continuation lines included
    expected: list[str]        # the expected output lines, as written
    out_start: int             # 0-based index of the first expected line in the file
    out_end: int               # 0-based index one past the last expected line


@dataclass
class Block:
    """A console block of a markdown file."""

    path: Path
    line: int                  # 1-based line of the opening fence
    lang: str
    commands: list[Command]
    skip: str | None = None    # the reason, when marked skip
    slow: bool = False
    requires: tuple[str, ...] = ()  # modules the block needs (skipped without them)
    indent: str = ""           # the opening fence's indentation (a block inside a list item)

    @property
    def id(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def doc_files(root: Path = REPO) -> list[Path]:
    """README.md and docs/*.md, in that order."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").glob("*.md"))


@functools.lru_cache(maxsize=None)
def _bash_incomplete(text: str) -> bool:
    """Whether bash would ask for another line (an open quote, ``if`` without ``fi``, ...)."""
    if text.endswith("\\"):
        return True
    proc = subprocess.run(["bash", "-n"], input=text + "\n", capture_output=True, text=True)
    return proc.returncode != 0 and ("unexpected EOF" in proc.stderr or "unexpected end of file" in proc.stderr)


def _fences(lines: list[str]) -> list[tuple[int, int, str]]:
    """(opening index, closing index, info word) of every fenced block (indented up to 3)."""
    out, i = [], 0
    while i < len(lines):
        m = _FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            j += 1
        out.append((i, j, lang))
        i = j + 1
    return out


def _parse_commands(lines: list[str], start: int, end: int) -> list[Command]:
    """The commands in ``lines[start:end]`` (a block's body)."""
    commands: list[Command] = []
    i = start
    while i < end and not lines[i].startswith("$ "):
        i += 1  # text before the first command is not checked
    while i < end:
        first = i
        text = lines[i][2:]
        i += 1
        while i < end and _bash_incomplete(text):
            text += "\n" + lines[i]
            i += 1
        out_start = i
        while i < end and not lines[i].startswith("$ "):
            i += 1
        commands.append(Command(line=first + 1, text=text, expected=lines[out_start:i],
                                out_start=out_start, out_end=i))
    return commands


def _dedent(line: str, indent: str) -> str:
    return line[len(indent):] if line.startswith(indent) else line.lstrip(" ")


def parse_file(path: Path) -> list[Block]:
    """Every console block of one markdown file."""
    raw = path.read_text(encoding="utf-8").split("\n")
    blocks = []
    for open_i, close_i, lang in _fences(raw):
        indent = raw[open_i][:len(raw[open_i]) - len(raw[open_i].lstrip(" "))]
        lines = raw[:open_i + 1] + [_dedent(ln, indent) for ln in raw[open_i + 1:close_i]] + raw[close_i:]
        body = lines[open_i + 1:close_i]
        if lang != "console" and not (lang == "text" and body and body[0].startswith("$ ")):
            continue
        skip, slow, requires = None, False, []
        prev = open_i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        m = _DIRECTIVE_RE.match(lines[prev]) if prev >= 0 else None
        for item in (m.group(1).split(",") if m else []):
            im = _ITEM_RE.fullmatch(item.strip())
            if im is None:
                raise ValueError(f"{_rel(path)}:{prev + 1}: unknown docs-check directive {item.strip()!r}; "
                                 "expected skip (reason), slow or requires MODULE")
            if im.group(1):
                skip = (im.group(2) or "").strip() or "marked skip"
            elif im.group(3):
                slow = True
            else:
                requires.append(im.group(4))
        blocks.append(Block(path=path, line=open_i + 1, lang=lang, skip=skip, slow=slow, indent=indent,
                            requires=tuple(requires), commands=_parse_commands(lines, open_i + 1, close_i)))
    return blocks


def skip_reason(block: Block, *, skip_slow: bool = False) -> str | None:
    """Why the block is not run now, or None."""
    if block.skip:
        return block.skip
    missing = [m for m in block.requires if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    if block.slow and skip_slow:
        return "slow"
    return None


def collect_blocks(files: list[Path] | None = None) -> list[Block]:
    return [b for f in (files if files is not None else doc_files()) for b in parse_file(f)]


def example_files(files: list[Path] | None = None) -> dict[str, str]:
    """``NAME.py`` -> text for every ```python block whose first line is ``# NAME.py``."""
    found: dict[str, str] = {}
    for path in files if files is not None else doc_files():
        lines = path.read_text(encoding="utf-8").split("\n")
        for open_i, close_i, lang in _fences(lines):
            if lang != "python" or close_i <= open_i + 1:
                continue
            m = _EXAMPLE_FILE_RE.match(lines[open_i + 1])
            if m:
                if m.group(1) in found:
                    raise ValueError(f"{_rel(path)}:{open_i + 1}: a second block defines {m.group(1)}")
                found[m.group(1)] = "\n".join(lines[open_i + 1:close_i]) + "\n"
    return found


# --------------------------------------------------------------------------- running


@dataclass
class CommandResult:
    command: Command
    actual: list[str]          # normalised real output
    status: int
    seconds: float
    ok: bool


@dataclass
class BlockResult:
    block: Block
    results: list[CommandResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def report(self) -> str:
        """A unified diff per failing command, named by file:line: the doc's text against what
        ``--update`` would write (the real output, with the doc's ``...`` kept where they fit)."""
        parts = []
        for r in self.results:
            if r.ok:
                continue
            where = f"{_rel(self.block.path)}:{r.command.line}"
            diff = difflib.unified_diff(_trim(r.command.expected), updated_expected(r.command.expected, r.actual),
                                        f"{where} (in the doc)", f"{where} (real output, exit {r.status})",
                                        lineterm="", n=2)
            parts.append(f"{where}: $ {r.command.text}\n" + "\n".join(diff))
        return "\n\n".join(parts)


@functools.lru_cache(maxsize=None)
def _tool_dir() -> str:
    """A directory with ``python`` (this interpreter) and ``shardplan``, put first on PATH."""
    d = Path(tempfile.mkdtemp(prefix="docs-check-bin-"))
    atexit.register(shutil.rmtree, d, True)
    exe = shlex.quote(sys.executable)
    for name, body in (("python", f'exec {exe} "$@"'), ("python3", f'exec {exe} "$@"'),
                       ("shardplan", f'exec {exe} -m shardplan "$@"')):
        (d / name).write_text(f"#!/bin/sh\n{body}\n")
        (d / name).chmod(0o755)
    return str(d)


def command_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(
        PATH=_tool_dir() + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        PYTHONPATH=str(REPO),
        NO_COLOR="1", TERM="dumb", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8", PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def _trim(lines: list[str]) -> list[str]:
    out = [ln.rstrip() for ln in lines]
    while out and not out[-1]:
        out.pop()
    return out


def _normalise_timings(lines: list[str]) -> list[str]:
    out = []
    for ln in lines:
        for pattern, repl in _TIMINGS:
            ln = pattern.sub(repl, ln)
        out.append(ln)
    return out


def normalise_output(text: str, tmp: str) -> list[str]:
    """Real output as the docs write it (see the module docstring)."""
    text = text.replace("\r\n", "\n")
    for path in sorted({tmp, os.path.realpath(tmp)}, key=len, reverse=True):
        text = text.replace(path, TMP_TOKEN)
    for path in sorted({str(REPO), os.path.realpath(REPO)}, key=len, reverse=True):
        text = text.replace(path, REPO_TOKEN)
    return _trim(text.split("\n"))


def matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` (with ``...`` lines) against ``actual``, both already trimmed."""
    exp = _normalise_timings(_trim(expected))
    act = _normalise_timings(actual)
    # reach[j]: expected[:i] can match actual[:j]
    reach = [True] + [False] * len(act)
    for e in exp:
        if e == ELLIPSIS:
            new, seen = [], False
            for r in reach:
                seen = seen or r
                new.append(seen)
        else:
            new = [False] + [reach[j] and act[j] == e for j in range(len(act))]
        reach = new
    return reach[-1]


def _run_command(text: str, cwd: str, env: dict[str, str], prev_status: int, timeout: float) -> tuple[str, int]:
    script = f"(exit {prev_status})\n{text}"
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return out.decode("utf-8", "replace") + f"\n[docs-check: timed out after {timeout:.0f} s]", 124
    return out.decode("utf-8", "replace"), proc.returncode


def run_block(block: Block, *, examples: dict[str, str] | None = None,
              timeout: float = COMMAND_TIMEOUT_S, warm: "_Zygote | None" = None) -> BlockResult:
    """Run the block's commands in a fresh temporary directory and compare their output."""
    examples = example_files() if examples is None else examples
    env = command_env()
    result = BlockResult(block)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="docs-check-") as tmp:
        for name, text in examples.items():
            Path(tmp, name).write_text(text, encoding="utf-8")
        for rel in COPIED_DIRS:
            if (REPO / rel).is_dir():
                shutil.copytree(REPO / rel, Path(tmp, rel))
        status = 0
        for cmd in block.commands:
            c0 = time.perf_counter()
            argv = _warm_argv(cmd.text) if warm is not None else None
            if argv is not None:
                out, status = warm.run(argv, tmp, env, timeout)
            else:
                out, status = _run_command(cmd.text, tmp, env, status, timeout)
            actual = normalise_output(out, tmp)
            result.results.append(CommandResult(cmd, actual, status, time.perf_counter() - c0,
                                                matches(cmd.expected, actual)))
    result.seconds = time.perf_counter() - t0
    return result


def _same_commands(block: Block) -> tuple[str, ...]:
    return tuple(c.text for c in block.commands)


def result_for(block: Block, shared: BlockResult) -> BlockResult:
    """``shared`` (a run of a block with the same commands) compared with ``block``'s text."""
    if shared.block is block:
        return shared
    out = BlockResult(block, seconds=0.0)
    for cmd, r in zip(block.commands, shared.results):
        out.results.append(CommandResult(cmd, r.actual, r.status, 0.0, matches(cmd.expected, r.actual)))
    return out


class Runner:
    """Runs blocks in a thread pool (``jobs`` at once), each distinct command list once."""

    def __init__(self, jobs: int = 1, *, fresh: bool | None = None) -> None:
        self.examples = example_files()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
        self.futures: dict[tuple[str, ...], concurrent.futures.Future[BlockResult]] = {}
        if fresh is None:
            fresh = os.environ.get("DOCS_CHECK_FRESH", "") not in ("", "0")
        self.warm = None if fresh else _Zygote.start()

    def submit(self, blocks: list[Block]) -> None:
        """Start the blocks not started yet, slow ones first."""
        for b in sorted(blocks, key=lambda b: not b.slow):
            key = _same_commands(b)
            if key not in self.futures:
                self.futures[key] = self.pool.submit(run_block, b, examples=self.examples, warm=self.warm)

    def result(self, block: Block) -> BlockResult:
        self.submit([block])
        return result_for(block, self.futures[_same_commands(block)].result())

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.warm is not None:
            self.warm.close()


def run_blocks(blocks: list[Block], *, jobs: int = 1, fresh: bool | None = None) -> dict[str, BlockResult]:
    """Run blocks, ``jobs`` at a time, slow ones first; keyed by block id."""
    runner = Runner(jobs, fresh=fresh)
    try:
        runner.submit(blocks)
        return {b.id: runner.result(b) for b in blocks}
    finally:
        runner.close()


def default_jobs() -> int:
    env = os.environ.get("DOCS_CHECK_JOBS")
    return int(env) if env else max(1, min(4, os.cpu_count() or 1))


# --------------------------------------------------------------------------- warm interpreter

_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=,@%+-]+")
_PRELOAD = ("torch", "shardplan", "shardplan.cli")  # what ``python -m shardplan`` imports anyway


def _warm_argv(text: str) -> list[str] | None:
    """The arguments of a plain ``python -m shardplan ARGS`` or ``shardplan ARGS``, else None."""
    words = text.split(" ")
    if not all(_PLAIN_WORD.fullmatch(w) for w in words):
        return None
    if words[:3] == ["python", "-m", "shardplan"]:
        return words[3:]
    if words[:1] == ["shardplan"]:
        return words[1:]
    return None


class _Zygote:
    """A process that has imported torch and shardplan and forks one child per command."""

    def __init__(self, proc: subprocess.Popen, sock: str, tmp: str) -> None:
        self.proc, self.sock, self.tmp = proc, sock, tmp
        self.lock = threading.Lock()

    @classmethod
    def start(cls, timeout: float = 120.0) -> "_Zygote | None":
        if not hasattr(socket, "send_fds") or not hasattr(os, "fork"):
            return None
        tmp = tempfile.mkdtemp(prefix="docs-check-warm-")
        sock = os.path.join(tmp, "sock")
        code = "import sys; from tests.docs_check import _zygote_main; _zygote_main(sys.argv[1])"
        proc = subprocess.Popen([sys.executable, "-c", code, sock], cwd=REPO, env=command_env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or proc.stdout.readline().strip() != b"ready":
            proc.kill()
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        z = cls(proc, sock, tmp)
        atexit.register(z.close)
        return z

    def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout: float) -> tuple[str, int]:
        """Run ``python -m shardplan *argv`` in a forked child: (merged output, exit status)."""
        r, w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.sock)
                socket.send_fds(conn, [b"F"], [w])
                os.close(w)
                w = -1
                conn.sendall(json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode() + b"\n")
                replies = conn.makefile("rb")
                pid = json.loads(replies.readline())["pid"]
                chunks, deadline, timed_out = [], time.monotonic() + timeout, False
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        timed_out = True
                        with contextlib.suppress(Exception):
                            os.killpg(pid, signal.SIGKILL)
                        break
                    if select.select([r], [], [], left)[0]:
                        data = os.read(r, 1 << 16)
                        if not data:
                            break
                        chunks.append(data)
                line = replies.readline()
            out = b"".join(chunks).decode("utf-8", "replace")
            if timed_out:
                return out + f"\n[docs-check: timed out after {timeout:.0f} s]", 124
            return out, json.loads(line)["status"] if line else 137
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    def close(self) -> None:
        with self.lock:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.tmp, ignore_errors=True)


def _zygote_main(sock_path: str) -> None:
    """The warm interpreter: import, then fork a child for every request on ``sock_path``."""
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # a broken tree: its commands fail in the child as they would anyway
            pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = srv.accept()
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        request = json.loads(conn.makefile("rb").readline())
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _zygote_child(conn, request, fds[0])
        conn.close()
        for fd in fds:
            os.close(fd)


def _zygote_child(conn: socket.socket, request: dict, fd: int) -> None:
    """Be ``python -m shardplan ARGS`` in the request's directory; never returns."""
    code = 1
    try:
        os.setsid()
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], PWD=request["cwd"])
        sys.path[0] = request["cwd"]           # what ``-m`` puts first
        sys.argv = ["python", *request["argv"]]  # runpy sets argv[0] to __main__.py
        with contextlib.suppress(Exception):  # return from run_module with SystemExit, not os._exit
            importlib.import_module("shardplan.cli").FAST_EXIT = False
        try:
            runpy.run_module("shardplan", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            conn.sendall(json.dumps({"status": code}).encode() + b"\n")
        os._exit(code)


# --------------------------------------------------------------------------- updating


def updated_expected(expected: list[str], actual: list[str]) -> list[str]:
    """New expected lines for ``actual``, keeping ``...`` lines of ``expected`` where they fit.

    A minimal-cost alignment: an expected line equal to an actual one is kept for free, a
    ``...`` absorbs any run of actual lines for free, a changed line costs less than a
    removed plus an added one. The result is the actual output with the absorbed runs
    written as ``...``.
    """
    exp = _trim(expected)
    if ELLIPSIS not in exp:
        return list(actual)
    n, m = len(exp), len(actual)
    exp_n, act_n = _normalise_timings(exp), _normalise_timings(actual)
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[tuple[str, int, int] | None]] = [[None] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    for i in range(n + 1):
        for j in range(m + 1):
            c = cost[i][j]
            if c == inf:
                continue
            steps = []
            if i < n and exp[i] == ELLIPSIS:
                steps.append(("skip", i + 1, j, 0.0))      # the elision ends here
                if j < m:
                    steps.append(("absorb", i, j + 1, 0.0))  # it absorbs actual[j]
            else:
                if i < n and j < m:
                    if exp_n[i] == act_n[j]:
                        steps.append(("keep", i + 1, j + 1, 0.0))
                    else:
                        ratio = difflib.SequenceMatcher(None, exp_n[i], act_n[j]).ratio()
                        steps.append(("change", i + 1, j + 1, 1.5 - ratio))
                if i < n:
                    steps.append(("drop", i + 1, j, 1.0))
            if j < m and (i == n or exp[i] != ELLIPSIS):
                steps.append(("add", i, j + 1, 1.0))
            for kind, ni, nj, w in steps:
                if c + w < cost[ni][nj]:
                    cost[ni][nj] = c + w
                    back[ni][nj] = (kind, i, j)
    ops = []
    i, j = n, m
    while (i, j) != (0, 0):
        kind, pi, pj = back[i][j]  # type: ignore[misc]
        ops.append((kind, pi, pj))
        i, j = pi, pj
    out: list[str] = []
    for kind, i, j in reversed(ops):
        if kind == "keep":
            out.append(exp[i])       # as written (a timing stays as it was)
        elif kind in ("change", "add"):
            out.append(actual[j])
        elif kind == "skip":
            out.append(ELLIPSIS)
    # an elision that now absorbs nothing next to another one, or at the start, is dropped
    dedup: list[str] = []
    for ln in out:
        if ln == ELLIPSIS and dedup and dedup[-1] == ELLIPSIS:
            continue
        dedup.append(ln)
    return dedup


def update_files(results: list[BlockResult]) -> list[str]:
    """Rewrite the expected output of every failing command in place; the ids changed."""
    changed: list[str] = []
    by_file: dict[Path, list[tuple[str, CommandResult]]] = {}
    for br in results:
        for r in br.results:
            if not r.ok:
                by_file.setdefault(br.block.path, []).append((br.block.indent, r))
                changed.append(f"{_rel(br.block.path)}:{r.command.line}")
    for path, failed in by_file.items():
        lines = path.read_text(encoding="utf-8").split("\n")
        for indent, r in sorted(failed, key=lambda x: x[1].command.out_start, reverse=True):
            new = [indent + ln if ln else ln for ln in updated_expected(r.command.expected, r.actual)]
            lines[r.command.out_start:r.command.out_end] = new
        path.write_text("\n".join(lines), encoding="utf-8")
    return changed


# --------------------------------------------------------------------------- command line


def _select(blocks: list[Block], wanted: list[str]) -> list[Block]:
    if not wanted:
        return blocks
    out = []
    for w in wanted:
        file, _, line = w.partition(":")
        path = (Path.cwd() / file).resolve()
        hit = [b for b in blocks if b.path.resolve() == path and (not line or b.line == int(line))]
        if not hit and (line or not path.is_file()):
            raise SystemExit(f"docs_check: no console block at {w}")
        out.extend(b for b in hit if b not in out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.docs_check", description=(
        "Run the console blocks of README.md and docs/*.md and compare their output (see this module's docstring)."))
    parser.add_argument("where", nargs="*", metavar="FILE[:LINE]", help="only these files, or the blocks at these lines")
    parser.add_argument("--update", action="store_true", help="rewrite the expected outputs that differ from real runs")
    parser.add_argument("--skip-slow", action="store_true", help="skip blocks marked <!-- docs-check: slow -->")
    parser.add_argument("--fresh", action="store_true", help="run every command as a new process (no warm interpreter)")
    parser.add_argument("-j", "--jobs", type=int, default=default_jobs(), help="blocks run at once (default: CPUs, at most 4)")
    args = parser.parse_args(argv)

    blocks = _select(collect_blocks(), args.where)
    todo = []
    for b in blocks:
        why = skip_reason(b, skip_slow=args.skip_slow)
        if why:
            print(f"skip  {b.id}  ({why})")
        else:
            todo.append(b)
    t0 = time.perf_counter()
    results = run_blocks(todo, jobs=args.jobs, fresh=args.fresh or None)
    failed = []
    for b in todo:
        r = results[b.id]
        print(f"{'ok' if r.ok else 'FAIL':<5} {b.id}  ({len(b.commands)} commands, {r.seconds:.1f} s)")
        if not r.ok:
            failed.append(r)
    for r in failed:
        print("\n" + r.report())
    print(f"\n{len(todo) - len(failed)} of {len(todo)} blocks match ({len(blocks) - len(todo)} skipped) "
          f"in {time.perf_counter() - t0:.1f} s")
    if args.update and failed:
        for where in update_files(failed):
            print(f"updated {where}")
        return 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
