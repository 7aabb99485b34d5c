"""Run functions on real gloo ranks on this machine, or under the fake process group.

Contract
--------
``run_on_gloo(fn, *, world_size, args=(), timeout_s=120.0, num_threads=1)``
    Starts ``world_size`` fresh Python processes with the ``spawn`` start method
    (never ``fork``), joins them into one gloo process group over
    ``tcp://127.0.0.1:<free port>`` and calls ``fn(rank, world_size, *args)`` in
    each.  Returns the per-rank results as a list indexed by rank.

    * ``fn`` and ``args`` are pickled and re-imported in the children, so ``fn``
      must be a module-level function of an importable module (not a lambda, a
      closure, or a function defined in an interactive ``__main__``).
    * Results must be picklable.  Tensors anywhere inside lists, tuples, dicts
      and named tuples come back detached and on CPU; each rank writes its result
      with ``torch.save`` to its own temp file, so large results cannot deadlock
      a pipe.  Return ``dtensor.full_tensor()`` or ``dtensor.to_local()`` rather
      than a ``DTensor``: a DTensor carries its device mesh, which does not
      outlive the process group.
    * Each child sets ``OMP_WAIT_POLICY=PASSIVE`` and ``OMP_NUM_THREADS`` (in the
      environment it is spawned with, so they apply before torch loads) and calls
      ``torch.set_num_threads(num_threads)``.
    * Every rank that finishes ``fn`` ends with ``dist.barrier()``,
      ``dist.destroy_process_group()`` and ``os._exit(0)``; gloo processes that
      exit through normal interpreter shutdown sometimes abort with
      "terminate called without an active exception".
    * If ``fn`` raises (anything, ``SystemExit`` included) on some rank, that
      rank records the formatted traceback and leaves with ``os._exit(1)``
      without entering the barrier; the parent kills the remaining ranks and
      raises ``RankError`` naming the rank and quoting its traceback.  A rank that
      dies without a traceback (a signal, a crash) is reported by exit code.
    * If ``timeout_s`` passes (counted from the call, process start-up
      included), the parent terminates and then kills every rank and raises
      ``RankTimeout`` naming the ranks still running.  The call never hangs.
    * If rank 0 cannot listen on the chosen port (another process took it), the
      whole group is restarted on a new port, a few times at most.

``fake_process_group`` and ``make_mesh`` live in :mod:`shardplan.apply.mesh` and are
re-exported here.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..apply.mesh import fake_process_group, make_mesh

__all__ = [
    "RankError",
    "RankTimeout",
    "fake_process_group",
    "make_mesh",
    "run_on_gloo",
]

_PORT_ATTEMPTS = 5
_EXIT_ADDR_IN_USE = 3
_TERMINATE_GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank of ``run_on_gloo`` raised or died.

    ``rank`` is the rank that failed first, ``traceback_text`` its worker
    traceback (or a note on how it died), ``failures`` every failed rank's text.
    """

    def __init__(self, message: str, *, rank: int, traceback_text: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text
        self.failures = dict(failures)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_rank_error, (str(self), self.rank, self.traceback_text, self.failures))


class RankTimeout(RuntimeError):
    """``run_on_gloo`` ran past its timeout; ``ranks`` were still running."""

    def __init__(self, message: str, *, ranks: tuple[int, ...], timeout_s: float) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_rank_timeout, (str(self), self.ranks, self.timeout_s))


def _rebuild_rank_error(message: str, rank: int, text: str, failures: dict[int, str]) -> RankError:
    return RankError(message, rank=rank, traceback_text=text, failures=failures)


def _rebuild_rank_timeout(message: str, ranks: tuple[int, ...], timeout_s: float) -> RankTimeout:
    return RankTimeout(message, ranks=ranks, timeout_s=timeout_s)


class _AddressInUse(Exception):
    """Rank 0 could not listen on the rendezvous port."""


# --------------------------------------------------------------------------- files


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.result.pt"


def _error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.error.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


# --------------------------------------------------------------------------- worker


def _to_cpu(obj: Any) -> Any:
    """Detach and move every tensor inside lists, tuples, named tuples and dicts to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_cpu(item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(item) for item in obj)
    if isinstance(obj, dict):
        converted = {key: _to_cpu(value) for key, value in obj.items()}
        if type(obj) is dict:
            return converted
        try:
            return type(obj)(converted)
        except Exception:
            return converted
    return obj


def _is_addr_in_use(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _fail(workdir: Path, rank: int, text: str) -> None:
    with contextlib.suppress(BaseException):
        _atomic_save({"time": time.time(), "traceback": text}, _error_path(workdir, rank))
    with contextlib.suppress(BaseException):
        sys.stderr.write(f"[shardplan.tools.launch rank {rank}] {text}")
    _flush_and_exit(1)


def _gloo_worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    num_threads: int,
    timeout_s: float,
    workdir: str,
) -> None:
    """Child-process entry point; always leaves through ``os._exit``."""
    out = Path(workdir)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        torch.set_num_threads(num_threads)
        try:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                init_method=f"tcp://127.0.0.1:{port}",
                timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
            )
        except Exception as exc:
            if _is_addr_in_use(exc):
                _flush_and_exit(_EXIT_ADDR_IN_USE)
            raise
        result = fn(rank, world_size, *args)
        _atomic_save(_to_cpu(result), _result_path(out, rank))
    except BaseException:
        _fail(out, rank, traceback.format_exc())
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        _fail(out, rank, "fn returned, but the exit barrier failed:\n" + traceback.format_exc())
    _flush_and_exit(0)


# --------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set environment variables (spawned children inherit them)."""
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _kill_all(procs: list[BaseProcess]) -> None:
    """Terminate, then kill, every rank still alive; reap them all."""
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(Exception):
                proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(Exception):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.join(_TERMINATE_GRACE_S)


def _failure_text(workdir: Path, rank: int, exitcode: int | None) -> tuple[float, str]:
    """(time recorded, traceback text) for a failed rank; ``inf`` when it recorded none."""
    path = _error_path(workdir, rank)
    if path.exists():
        with contextlib.suppress(Exception):
            record = _load(path)
            return float(record["time"]), str(record["traceback"])
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return math.inf, (
        f"rank {rank} {how} without recording a traceback "
        "(it may have failed while starting up or importing fn; see its stderr)\n"
    )


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")


def _blame(rank: int, exitcode: int | None, recorded: float, text: str) -> tuple:
    """Sort key of a failed rank, root cause first. The parent has killed nobody yet when
    this runs, so a rank killed by SIGKILL (the OOM killer, a user) or crashed by SIGSEGV
    died first; then ranks whose own code raised; then other silent exits (an abort);
    last, ranks whose traceback only says that a peer hung up, which follows the others."""
    if recorded == math.inf:
        return (0 if exitcode in (-9, -11) else 2, rank)
    return (3 if any(s in text for s in _PEER_GONE) else 1, recorded, rank)


def _raise_rank_error(workdir: Path, procs: list[BaseProcess]) -> None:
    failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
    texts = {rank: _failure_text(workdir, rank, procs[rank].exitcode) for rank in failed}
    order = sorted(failed, key=lambda rank: _blame(rank, procs[rank].exitcode, *texts[rank]))
    first = order[0]
    failures = {rank: texts[rank][1] for rank in order}
    message = f"rank {first} of {len(procs)} failed:\n{failures[first]}"
    if len(order) > 1:
        others = ", ".join(f"rank {rank}" for rank in order[1:])
        message += f"(afterwards also failed: {others}; see RankError.failures)"
    raise RankError(message, rank=first, traceback_text=failures[first], failures=failures)


def _raise_timeout(workdir: Path, procs: list[BaseProcess], timeout_s: float) -> None:
    running = tuple(rank for rank, proc in enumerate(procs) if proc.is_alive())
    in_barrier = [rank for rank in running if _result_path(workdir, rank).exists()]
    message = f"run_on_gloo timed out after {timeout_s:g}s; ranks still running: {list(running)}"
    if in_barrier:
        message += f" (ranks {in_barrier} had returned from fn and were waiting in the exit barrier)"
    raise RankTimeout(message, ranks=running, timeout_s=timeout_s)


def _supervise(procs: list[BaseProcess], workdir: Path, deadline: float, timeout_s: float) -> None:
    """Wait until all ranks exit cleanly; raise on the first failure or at the deadline."""
    while True:
        exitcodes = [proc.exitcode for proc in procs]
        if any(code == _EXIT_ADDR_IN_USE for code in exitcodes):
            raise _AddressInUse()
        if any(code not in (None, 0) for code in exitcodes):
            _raise_rank_error(workdir, procs)
        alive = [proc for proc in procs if proc.exitcode is None]
        if not alive:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _raise_timeout(workdir, procs, timeout_s)
        multiprocessing.connection.wait([proc.sentinel for proc in alive], timeout=remaining)


def _collect_results(workdir: Path, world_size: int) -> list[Any]:
    results = []
    for rank in range(world_size):
        path = _result_path(workdir, rank)
        if not path.exists():
            text = f"rank {rank} exited cleanly but wrote no result\n"
            raise RankError(text, rank=rank, traceback_text=text, failures={rank: text})
        results.append(_load(path))
    return results


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            "run_on_gloo spawns fresh processes, so fn must be a module-level function of an "
            f"importable module and args must be picklable: {exc}"
        ) from exc


def _run_attempt(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...],
    num_threads: int,
    timeout_s: float,
    deadline: float,
    workdir: Path,
) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs: list[BaseProcess] = []
    env = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(num_threads)}
    try:
        with _environ(env):
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_gloo_worker,
                    args=(fn, rank, world_size, args, port, num_threads, timeout_s, str(workdir)),
                    name=f"shardplan-gloo-rank{rank}",
                )
                proc.start()
                procs.append(proc)
        _supervise(procs, workdir, deadline, timeout_s)
    finally:
        _kill_all(procs)
    return _collect_results(workdir, world_size)


def run_on_gloo(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    num_threads: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Returns the results indexed by rank (tensors detached, on CPU).  Raises
    ``RankError`` if a rank fails and ``RankTimeout`` after ``timeout_s``
    seconds.  ``fn`` must be a module-level, importable function (spawn).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    args = tuple(args)
    _check_picklable(fn, args)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="shardplan-gloo-") as tmp:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            workdir = Path(tmp) / f"attempt{attempt}"
            workdir.mkdir()
            try:
                return _run_attempt(
                    fn,
                    world_size=world_size,
                    args=args,
                    num_threads=num_threads,
                    timeout_s=timeout_s,
                    deadline=deadline,
                    workdir=workdir,
                )
            except _AddressInUse:
                continue
    raise RuntimeError(f"run_on_gloo: rank 0 found its rendezvous port in use {_PORT_ATTEMPTS} times in a row")
