"""Real rank processes on gloo over 127.0.0.1: shm and torch transports agree with the MIN computed
locally, count calls exactly, fail with CollectiveTimeout (never hang) when a rank stops, and leave
nothing in /dev/shm."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

SHM_DIR = "/dev/shm"

pytestmark = pytest.mark.multiprocess


def launch(scenario: str, world: int, args: dict[str, Any], timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``scenario``; return per rank {returncode, report (or None), stderr}.

    The rendezvous store lives in this process on a kernel-chosen port, so parallel tests never race
    for a port. Each rank is a process of its own, forked from a fork server that imported torch once
    (``dist_worker.run_rank``); its exit code is the process's (negative: killed by that signal).
    """
    import torch.distributed as dist

    from tests.comm import dist_worker

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", dist_worker.__name__])  # when the server starts
    with tempfile.TemporaryDirectory(prefix="tpcache-dist-") as tmp:
        files = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")) for rank in range(world)]
        argvs = [[scenario, str(rank), str(world), str(store.port), json.dumps(args)] for rank in range(world)]
        procs = [
            ctx.Process(target=dist_worker.run_rank, args=(argvs[r], *files[r]), daemon=True) for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            late = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
            assert not late, f"ranks {late} did not finish within {timeout_s} s"
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        results = []
        for proc, (out_path, err_path) in zip(procs, files, strict=True):
            lines = Path(out_path).read_text().strip().splitlines() if os.path.exists(out_path) else []
            err = Path(err_path).read_text() if os.path.exists(err_path) else ""
            report = json.loads(lines[-1]) if lines else None
            results.append({"returncode": proc.exitcode, "report": report, "stderr": err[-3000:]})
    return results


def segment_files_of(pids: set[int]) -> list[str]:
    """Segments in /dev/shm created by any of ``pids`` (names carry the creator pid)."""
    found = []
    for name in os.listdir(SHM_DIR):
        if name.startswith("tpcache-round-"):
            pid = name.split("-")[2]
            if pid.isdigit() and int(pid) in pids:
                found.append(name)
    return found


def reports(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, res in enumerate(results):
        assert res["returncode"] == 0 and res["report"] is not None, f"rank {rank} failed:\n{res['stderr']}"
    return [res["report"] for res in results]


@pytest.mark.parametrize(
    ("world", "rounds", "shm_only_rounds"),
    [(1, 20, 0), (2, 60, 0), (3, 40, 0), (4, 20, 500), (8, 10, 40)],
    ids=["w1", "w2", "w3", "w4-oversubscribed-500", "w8"],
)
def test_shm_and_torch_agree_with_the_min(world: int, rounds: int, shm_only_rounds: int) -> None:
    args = {"seed": 1000 + world, "capacity": 64, "rounds": rounds, "shm_only_rounds": shm_only_rounds}
    args["checks"] = world == 2
    args["jitter_ms"] = 3 if world == 3 else 0  # late arrivals: waiters also sleep on the futex
    out = reports(launch("compare", world, args))
    extra = 1 if args["checks"] else 0  # the "still works" round after the local checks
    for rank, rep in enumerate(out):
        assert rep["rank"] == rank
        assert (rep["shm_name"], rep["torch_name"]) == ("shm", "gloo")
        assert rep["wrong"] == {"shm": 0, "torch": 0}
        assert rep["calls"] == {"shm": rounds + shm_only_rounds + extra, "torch": rounds + extra}
        assert rep["segment_linked_after_setup"] is False  # unlinked once every rank mapped it
        assert rep["closed_raises"] is True
        if args["checks"]:
            for transport in ("shm", "gloo"):
                assert rep["checks"][transport] == {
                    "too_long": "ValueError",
                    "overflow": "ValueError",
                    "underflow": "ValueError",
                    "float": "ValueError",
                    "str": "ValueError",
                    "worker_thread": "WrongThreadError",
                    "calls_unchanged": True,
                    "still_works": True,
                }
    assert len({rep["segment"] for rep in out}) == 1
    assert segment_files_of({rep["pid"] for rep in out}) == []


@pytest.mark.parametrize("mode", ["sleep", "kill"])
def test_survivors_time_out_naming_the_missing_rank(mode: str, tmp_path: Path) -> None:
    timeout = 1.5
    args = {
        "transports": ["shm", "torch"],  # in turn, in the same processes
        "victim": 2,
        "mode": mode,
        "timeout": timeout,
        "rounds_before": 3,
        "sleep_s": 50.0,  # the sleeping victim wakes when both survivors are done (see dist_worker)
        "sync_dir": str(tmp_path),
    }
    if mode == "kill":
        # A dead rank is noticed from its pid, not waited out: with a timeout longer than launch's
        # own, only that path can end the round in time (a wait would fail the test, never pass it).
        args["stall_timeouts"] = {"shm": 600.0}
    results = launch("stall", 3, args, timeout_s=60)
    if mode == "kill":
        assert results[2]["returncode"] == -9
    survivors = reports(results[:2])
    for rep in survivors:
        for transport in ("shm", "gloo"):
            outcome = rep[transport]
            # A CollectiveTimeout at all is the bound: a survivor that hung would keep launch waiting
            # until its timeout, which fails the test.
            assert outcome["error"] == "CollectiveTimeout", outcome
            assert outcome["after"] == "CollectiveClosed"  # the collective is broken for good
        assert rep["shm"]["missing"] == [2]
        assert "rank(s) [2]" in rep["shm"]["message"]
        if mode == "kill":
            assert "will not arrive" in rep["shm"]["message"] and "exited" in rep["shm"]["message"], rep["shm"]
        else:
            assert f"did not arrive within {timeout:g} s" in rep["shm"]["message"], rep["shm"]
        assert rep["gloo"]["missing"] == []
        assert "does not report which ranks" in rep["gloo"]["message"]
    assert segment_files_of({rep["pid"] for rep in survivors}) == []


def test_torn_record_is_never_used() -> None:
    out = reports(launch("torn", 2, {"timeout": 1.0}))
    assert out[0]["error"] == "CollectiveTimeout"
    assert out[0]["missing"] == [1]
    assert "result" not in out[0]


def test_auto_falls_back_to_torch_on_every_rank_when_shm_is_unusable(tmp_path: Path) -> None:
    out = reports(launch("fallback", 2, {"missing_dir": str(tmp_path / "absent")}))
    for rank, rep in enumerate(out):
        assert rep["auto"] == "gloo"
        assert rep["result"] == [0, -1]
        assert rep["forced"] == "ShmUnavailable"
        assert any("shared memory unavailable" in m for m in rep["log"])
        assert any(m.startswith(f"round transport: gloo (rank {rank} of 2)") for m in rep["log"])


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
def test_nccl_and_shm_agree_with_the_min() -> None:
    if cuda_devices() < 1:
        pytest.skip("needs a CUDA device")
    world = min(2, cuda_devices())
    args = {"seed": 7, "capacity": 64, "rounds": 40, "shm_only_rounds": 0, "checks": True, "backend": "nccl"}
    for rep in reports(launch("compare", world, args)):
        assert (rep["shm_name"], rep["torch_name"]) == ("shm", "nccl")
        assert rep["wrong"] == {"shm": 0, "torch": 0}
        assert rep["calls"] == {"shm": 41, "torch": 41}
        assert rep["checks"]["nccl"]["still_works"] is True


@pytest.mark.gpu
def test_nccl_survivor_times_out_without_hanging(tmp_path: Path) -> None:
    if cuda_devices() < 2:
        pytest.skip("needs two CUDA devices")
    args = {
        "transports": ["torch"],
        "victim": 1,
        "mode": "sleep",
        "timeout": 1.5,
        "rounds_before": 3,
        "sleep_s": 80.0,  # until the survivor is done
        "sync_dir": str(tmp_path),
        "backend": "nccl",
    }
    outcome = reports(launch("stall", 2, args, timeout_s=90))[0]["nccl"]
    assert outcome["error"] == "CollectiveTimeout"  # a hang would keep launch waiting, and fail
    assert outcome["after"] == "CollectiveClosed"
