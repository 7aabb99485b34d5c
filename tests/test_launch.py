"""Tests for shardplan.tools.launch: real gloo ranks (spawned) and the fake process group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import shardplan.tools.launch as launch
from shardplan.tools.launch import RankError, RankTimeout, fake_process_group, make_mesh, run_on_gloo

# Worker functions must be module-level: spawned children re-import this module by name.


def _all_reduce_worker(rank: int, world_size: int) -> torch.Tensor:
    value = torch.tensor([rank + 1.0], requires_grad=False)
    dist.all_reduce(value)
    return value


def _raise_on_rank1_worker(rank: int, world_size: int, message: str) -> int:
    if rank == 1:
        raise ValueError(message)
    return rank


def _sleep_on_rank0_worker(rank: int, world_size: int) -> int:
    if rank == 0:
        while True:
            time.sleep(1.0)
    return rank


def _nested_result_worker(rank: int, world_size: int) -> dict[str, object]:
    grad = torch.ones(3, requires_grad=True) * (rank + 1)
    return {"rank": rank, "tensors": [grad, (torch.arange(2),)], "world": world_size}


def test_run_on_gloo_all_reduce() -> None:
    results = run_on_gloo(_all_reduce_worker, world_size=2, timeout_s=120.0)
    assert len(results) == 2
    for result in results:
        assert isinstance(result, torch.Tensor)
        torch.testing.assert_close(result, torch.tensor([3.0]))


def test_run_on_gloo_nested_results_come_back_detached_on_cpu() -> None:
    results = run_on_gloo(_nested_result_worker, world_size=2)
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world"] == 2
        grad, (arange,) = result["tensors"]
        assert not grad.requires_grad and grad.device.type == "cpu"
        torch.testing.assert_close(grad, torch.full((3,), rank + 1.0))
        torch.testing.assert_close(arange, torch.arange(2))


def test_run_on_gloo_rank_error_names_rank_and_message() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_gloo(_raise_on_rank1_worker, world_size=2, args=("boom from the worker",), timeout_s=60.0)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 1" in text
    assert "boom from the worker" in text
    assert "ValueError" in text
    assert info.value.rank == 1
    assert "boom from the worker" in info.value.traceback_text
    assert isinstance(info.value, RuntimeError)
    assert elapsed < 30.0, f"RankError took {elapsed:.1f}s"


def test_run_on_gloo_timeout_kills_ranks() -> None:
    timeout_s = 5.0
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_gloo(_sleep_on_rank0_worker, world_size=2, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 8.0, f"RankTimeout took {elapsed:.1f}s"
    assert 0 in info.value.ranks
    assert "rank" in str(info.value) and "5s" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_run_on_gloo_retries_when_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rendezvous port found in use starts a fresh attempt on a new port.

    (Holding a real listening socket to provoke this was flaky: TCPStore may share the port
    with SO_REUSEADDR and rank 1 then connects to the wrong listener.)"""
    real_attempt = launch._run_attempt
    calls: list[int] = []

    def first_port_taken(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise launch._AddressInUse()
        return real_attempt(*a, **kw)

    monkeypatch.setattr(launch, "_run_attempt", first_port_taken)
    results = run_on_gloo(_all_reduce_worker, world_size=2, timeout_s=120.0)
    assert len(calls) == 2
    for result in results:
        torch.testing.assert_close(result, torch.tensor([3.0]))


def test_run_on_gloo_rejects_unpicklable_fn() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_on_gloo(lambda rank, world: rank, world_size=2)


def test_fake_process_group_and_make_mesh_reinit_with_other_size() -> None:
    with fake_process_group(8):
        mesh = make_mesh({"tp": 8})
        assert mesh.size() == 8
        assert mesh.mesh_dim_names == ("tp",)
    assert not dist.is_initialized()
    with fake_process_group(64):
        mesh = make_mesh({"dp": 8, "tp": 8})
        assert mesh.size() == 64
        assert mesh.mesh_dim_names == ("dp", "tp")
        assert mesh["tp"].size() == 8
        assert mesh.shape == (8, 8)
    assert not dist.is_initialized()


def test_make_mesh_mismatched_product_raises() -> None:
    with fake_process_group(8):
        with pytest.raises(ValueError, match=r"12.*8"):
            make_mesh({"dp": 3, "tp": 4})


def test_fake_process_group_refuses_existing_group() -> None:
    with fake_process_group(4):
        with pytest.raises(RuntimeError, match="already initialized"):
            with fake_process_group(2):
                pass
        assert dist.get_world_size() == 4
    assert not dist.is_initialized()



def test_a_rank_killed_first_is_blamed_not_the_peer_that_saw_it_hang_up(tmp_path) -> None:
    """The race seen on real runs: rank 1 is SIGKILLed, rank 0's collective fails with
    'Connection closed by peer' and records that traceback before the parent looks."""
    from types import SimpleNamespace

    launch._atomic_save({"time": 1.0, "traceback": "RuntimeError: Connection closed by peer [127.0.0.1]:1234\n"},
                        launch._error_path(tmp_path, 0))
    procs = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=-9)]
    with pytest.raises(RankError) as info:
        launch._raise_rank_error(tmp_path, procs)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 failed:\nrank 1 was killed by signal 9")
