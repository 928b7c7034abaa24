"""Where a vLLM worker's CPU goes: tpcache's share of each engine step (for ``scripts/bench_vllm.py``).

``TimedTPCacheConnector`` is the connector with every worker-side hook timed. Choose it in place of
``TPCacheConnector`` (same ``kv_connector_module_path`` with this module's name) to measure; it
serves exactly as the connector does. Per worker it counts:

- ``hook_cpu_s``: thread CPU time spent inside each hook vLLM calls on the worker (the step's round,
  its copies where they are made on the calling thread, the reports);
- ``threads_cpu_s``: CPU time of tpcache's own threads (copies, storage, events), read from
  ``/proc`` for every live thread whose name starts with ``tpcache``;
- ``step_cpu_s``: the worker process's CPU time from one step's ``bind_connector_metadata`` to the
  next (vLLM binds the step's metadata once per forward pass), over ``steps`` steps.

The overhead is ``(hook + threads) / step``. Nothing here decides cache state.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

from tpcache.integrations.vllm.connector import TPCacheConnector

# The worker-side hooks vLLM calls (those the connector defines are timed).
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "handle_preemptions",
    "get_kv_connector_stats",
)

_TICKS = os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process, from ``/proc``."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)


class _Clock:
    """The counts of one worker process (one connector instance per worker)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hook_cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.steps = 0
        self.step_cpu_s = 0.0
        self._last_bind: float | None = None
        self._threads_at_reset = self._threads_cpu()

    @staticmethod
    def _threads_cpu() -> dict[int, float]:
        return {
            t.native_id: _thread_cpu_s(t.native_id)
            for t in threading.enumerate()
            if t.name.startswith("tpcache") and t.native_id is not None
        }

    def step_bound(self) -> None:
        now = time.process_time()
        if self._last_bind is not None:
            self.steps += 1
            self.step_cpu_s += now - self._last_bind
        self._last_bind = now

    def add(self, hook: str, seconds: float) -> None:
        self.hook_cpu_s[hook] = self.hook_cpu_s.get(hook, 0.0) + seconds
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        start = self._threads_at_reset
        threads = sum(cpu - start.get(tid, 0.0) for tid, cpu in self._threads_cpu().items())
        return {
            "hook_cpu_s": dict(self.hook_cpu_s),
            "hook_calls": dict(self.calls),
            "threads_cpu_s": max(0.0, threads),
            "steps": self.steps,
            "step_cpu_s": self.step_cpu_s,
        }


CLOCK = _Clock()


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "bind_connector_metadata":
            CLOCK.step_bound()
        start = time.thread_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            CLOCK.add(name, time.thread_time() - start)

    return hook


class TimedTPCacheConnector(TPCacheConnector):
    """``TPCacheConnector`` with its worker-side hooks timed (see the module docstring)."""


for _name in WORKER_HOOKS:
    _fn = getattr(TPCacheConnector, _name, None)
    if callable(_fn):
        setattr(TimedTPCacheConnector, _name, _timed(_name, _fn))


def timing_stats(worker: Any = None) -> dict[str, Any]:
    """This worker's counts since the last ``reset_timing`` (for ``LLM.collective_rpc``)."""
    return CLOCK.snapshot()


def reset_timing(worker: Any = None) -> None:
    """Start counting again (for ``LLM.collective_rpc``)."""
    CLOCK.reset()
