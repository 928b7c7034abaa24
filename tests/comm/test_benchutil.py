"""Benchmark helpers: a timed call's setup runs before every call, untimed, in the same order."""

from __future__ import annotations

from tpcache.comm.benchutil import interleaved


def test_interleaved_runs_each_setup_once_before_each_timed_call() -> None:
    log: list[str] = []
    samples = interleaved(
        {
            "plain": lambda: log.append("plain"),
            "work": (lambda: log.append("setup"), lambda: log.append("work")),
        },
        rounds=4,
        blocks=2,
        warmup=1,
    )
    assert {name: len(s) for name, s in samples.items()} == {"plain": 4, "work": 4}
    warm = ["plain", "setup", "work"]
    block = ["plain", "plain", "setup", "work", "setup", "work"]
    assert log == warm + block + block
