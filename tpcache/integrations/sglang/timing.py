"""Where a SGLang scheduler's CPU goes in its prefix cache (for ``scripts/bench_sglang.py``).

Inert unless ``TPCACHE_SGLANG_TIMING=<directory>`` is set: then tpcache's plugin (which SGLang runs
in every scheduler process) wraps, before the scheduler is built, every method of SGLang's prefix
caches (``UnifiedRadixCache``: its radix cache, and HiCache when ``--enable-hierarchical-cache``
is on; ``BasePrefixCache``) and of tpcache's backend (``TPCacheRadix``), and the collectives they
issue (``torch.distributed``'s, on SGLang's gloo TP CPU group; tpcache's round). Per scheduler
process it counts:

- ``cache_cpu_s``: the scheduler thread's CPU time inside the cache's methods (outermost calls
  only), which includes the collectives those methods issue;
- ``collective_cpu_s`` and ``collectives``: the part of it spent in those collectives, and their
  number;
- ``steps``: scheduler steps that ran a batch (SGLang calls the cache's ``flush_pending_backups``
  once after each batch).

After each step it writes them to ``<directory>/sched-<pid>.json``. Counting starts at the first
``match_prefix`` (the cache's setup is not counted), and skips setup methods (``init_*``,
host-resource release, storage attach and detach). Cache work the scheduler does on idle loop
iterations (HiCache's event checks) is counted too, against the steps that ran a batch. Nothing here decides cache
state.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV = "TPCACHE_SGLANG_TIMING"
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "reduce_scatter",
    "reduce_scatter_tensor",
)
SKIPPED = ("release_host_resources", "attach_storage_backend", "detach_storage_backend", "clear_storage_backend")


class _Counts(threading.local):
    depth = 0
    in_collective = False
    serving = False  # from the first match_prefix on (the cache's setup before it is not counted)


_counts = _Counts()
_totals = {"steps": 0, "cache_cpu_s": 0.0, "collective_cpu_s": 0.0, "collectives": 0}
_out: Path | None = None


def _timed_method(fn: Any, name: str) -> Any:
    step = name == "flush_pending_backups"
    first = name == "match_prefix"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        local = _counts
        if first:
            local.serving = True
        if local.depth or not local.serving:
            return fn(*args, **kwargs)
        local.depth = 1
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals["cache_cpu_s"] += time.thread_time() - start
            local.depth = 0
            if step:
                _totals["steps"] += 1
                _write()

    wrapper.__tpcache_timed__ = True
    return wrapper


def _timed_collective(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        local = _counts
        if not local.depth or local.in_collective:
            return fn(*args, **kwargs)
        local.in_collective = True
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals["collective_cpu_s"] += time.thread_time() - start
            _totals["collectives"] += 1
            local.in_collective = False

    wrapper.__tpcache_timed__ = True
    return wrapper


def _write() -> None:
    if _out is None:
        return
    tmp = _out.with_suffix(".tmp")
    tmp.write_text(json.dumps(_totals))
    os.replace(tmp, _out)


def _wrap_class(cls: type) -> None:
    for name, fn in list(vars(cls).items()):
        if not inspect.isfunction(fn) or name.startswith(("__", "init")) or name in SKIPPED:
            continue
        if not getattr(fn, "__tpcache_timed__", False):
            setattr(cls, name, _timed_method(fn, name))


def install(directory: str) -> None:
    """Wrap the caches' methods and their collectives in this process (idempotent)."""
    global _out
    if _out is not None:
        return
    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from tpcache.comm.collective import Collective
    from tpcache.integrations.sglang.radix import TPCacheRadix

    Path(directory).mkdir(parents=True, exist_ok=True)
    _out = Path(directory) / f"sched-{os.getpid()}.json"
    for cls in (BasePrefixCache, UnifiedRadixCache, TPCacheRadix):
        _wrap_class(cls)
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__tpcache_timed__", False):
            setattr(dist, name, _timed_collective(fn))
    Collective.allreduce_min = _timed_collective(Collective.allreduce_min)  # tpcache's round
