"""tpcache's counters in vLLM's own statistics: its stats logging and its Prometheus ``/metrics``.

vLLM collects a ``KVConnectorStats`` from the scheduler's connector and from every worker's once per
engine step, merges them (``aggregate``) and hands the merged counts to its loggers: the periodic
"KV Transfer metrics" log line and the Prometheus counters built by ``build_prom_metrics``. Every
count here is an increment since the last collection:

- the scheduler side counts what vLLM was told: tokens it loads from tpcache by tier, lookups,
  preemptions, and what a preempted request got back from tpcache or computed again;
- the scheduler side also counts, with vLLM's ``kv_events_config`` on, how tpcache's pages were
  named in vLLM's KV events (``event_pages_*``: mapped, and what the bounded map forgot or could not map);
- the workers count copies and closes. Those are agreed by every rank (a page counts as loaded
  once it landed on every rank), so only TP rank 0 reports them: each is counted once per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# counter -> what it counts (its Prometheus help text)
COUNTERS: dict[str, str] = {
    "hit_tokens_host": "Prompt tokens vLLM loaded from tpcache's host tier",
    "hit_tokens_storage": "Prompt tokens vLLM loaded from tpcache's storage tier",
    "lookups": "Prompts looked up in tpcache",
    "stale_lookups_refreshed": "Waiting requests looked up again because a later save extended their hit",
    "preemptions": "Requests vLLM preempted while tpcache served them",
    "preempted_loaded_tokens": "Tokens of preempted requests loaded back from tpcache instead of recomputed",
    "preempted_recomputed_tokens": "Tokens of preempted requests that vLLM computed again",
    "load_wait_steps": "Engine steps requests sat out of the batch waiting for their asynchronous loads",
    "loaded_pages": "Pages copied from tpcache into vLLM's KV blocks (landed on every rank)",
    "failed_load_blocks": "KV blocks whose load failed on some rank (vLLM recomputes them)",
    "saved_pages": "Pages copied from vLLM's KV blocks into tpcache's host tier",
    "storage_written_pages": "Pages written to tpcache's storage tier",
    "host_evicted_pages": "Pages evicted from tpcache's host tier",
    "closes": "Times the cache closed (it serves misses until the ranks reopen it)",
    "event_pages_mapped": "tpcache pages named in vLLM's KV events under vLLM's block hash",
    "event_pages_forgotten": "tpcache pages whose vLLM block hash the bounded event map let go (oldest first)",
    "event_pages_unmapped": "tpcache page changes left out of vLLM's KV events (no vLLM block hash known)",
}

HIT_TIERS = {"hit_tokens_host": "host", "hit_tokens_storage": "storage"}


@dataclass
class TPCacheStats(KVConnectorStats):
    """Counter increments (``COUNTERS``), summed when vLLM merges workers, steps and the scheduler."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> TPCacheStats:
        out = dict(self.data)
        for key, value in (other.data if isinstance(other, TPCacheStats) else {}).items():
            out[key] = out.get(key, 0) + value
        return TPCacheStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {f"tpcache_{k}": self.data[k] for k in COUNTERS if self.data.get(k)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Increments:
    """Turns running totals into increments since the last call (None when nothing moved)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def take(self, totals: dict[str, int]) -> TPCacheStats | None:
        data = {}
        for key, value in totals.items():
            delta = int(value) - self.last.get(key, 0)
            if delta > 0:
                data[key] = delta
            self.last[key] = int(value)
        return TPCacheStats(data=data) if data else None


class TPCachePromMetrics(KVConnectorPromMetrics):
    """``vllm:tpcache_*`` counters on vLLM's ``/metrics``, one child per engine; the hits carry a
    ``tier`` label (``host`` or ``storage``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        hits = self._counter_cls(
            name="vllm:tpcache_hit_tokens",
            documentation="Prompt tokens vLLM loaded from tpcache, by tier",
            labelnames=[*labelnames, "tier"],
        )
        self.children: dict[str, dict[int, Any]] = {}
        for key, tier in HIT_TIERS.items():
            self.children[key] = {i: hits.labels(*values, tier) for i, values in per_engine_labelvalues.items()}
        for key, doc in COUNTERS.items():
            if key in HIT_TIERS:
                continue
            counter = self._counter_cls(name=f"vllm:tpcache_{key}", documentation=doc, labelnames=labelnames)
            self.children[key] = {i: counter.labels(*values) for i, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            child = self.children.get(key, {}).get(engine_idx)
            if child is not None and value > 0:
                child.inc(value)
