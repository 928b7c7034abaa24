"""Prometheus metrics of one rank, on its own CollectorRegistry (never the global one).

The round loop (main thread) publishes a snapshot of the cache's counters at most every
``interval_s``; scrapes (the HTTP server's thread) read only that snapshot, so a scrape never
touches the cache while the main thread mutates it. Round latency and requests are recorded as
they happen (prometheus_client's own types are thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

ROUND_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0)

# (metric suffix, help, label name, {label value: stats key})
_COUNTERS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    (
        "hit_tokens",
        "Tokens served from the cache, by tier",
        "tier",
        {"device": "device_hit_tokens", "host": "host_hit_tokens", "storage": "storage_hit_tokens"},
    ),
    ("lookup_tokens", "Tokens of full pages looked up by lock", "", {"": "lookup_tokens"}),
    ("storage_lookups", "Lookups of a prefix's continuation in the storage tier", "", {"": "storage_lookups"}),
    (
        "evicted_pages",
        "Pages evicted, by tier",
        "tier",
        {"device": "device_evicted_pages", "host": "host_evicted_pages"},
    ),
    (
        "transfer_pages",
        "Pages copied between tiers, by kind and state",
        "kind_state",
        {
            "backup/issued": "backups_issued_pages",
            "backup/done": "backups_done_pages",
            "load/issued": "loads_issued_pages",
            "load/done": "loads_done_pages",
            "storage_read/done": "prefetch_read_pages",
        },
    ),
    (
        "storage_write_pages",
        "Pages written to the storage tier, by state",
        "state",
        {"issued": "storage_write_issued_pages", "written": "storage_written_pages"},
    ),
    (
        "rejected_pages",
        "Pages a copy or write could not take, by reason",
        "reason",
        {"host_full": "backup_rejected_host_full", "copy_failed": "failed_copy_pages"},
    ),
    ("inserted_pages", "Pages inserted", "", {"": "inserted_pages"}),
    ("mirrors_released_pages", "Host mirrors released under pressure", "", {"": "mirrors_released_pages"}),
)


class RankMetrics:
    def __init__(self, rank: int, interval_s: float = 0.25) -> None:
        self.rank = rank
        self.interval_s = interval_s
        self.registry = CollectorRegistry(auto_describe=True)
        self.round_seconds = Histogram(
            "tpcache_round_duration_seconds",
            "Wall time of one round (prepare, all-reduce, commit)",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "tpcache_requests", "Client requests answered, by op and outcome", ["op", "outcome"], registry=self.registry
        )
        self.batch_requests = Histogram(
            "tpcache_batch_requests",
            "Client requests applied per round",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=self.registry,
        )
        self._snapshot: dict[str, Any] = {}
        self._health: dict[str, Any] = {}
        self._last = 0.0
        self.registry.register(_SnapshotCollector(self))
        self.server: Any = None

    def observe_round(self, seconds: float, requests: int) -> None:
        self.round_seconds.observe(seconds)
        self.batch_requests.observe(requests)

    def publish(self, stats: dict[str, Any], health: dict[str, Any], force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._snapshot, self._health, self._last = stats, health, now

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        result = start_http_server(port, addr=addr, registry=self.registry)
        self.server = result[0] if isinstance(result, tuple) else None

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _SnapshotCollector:
    def __init__(self, metrics: RankMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats, health = self.m._snapshot, self.m._health
        for suffix, text, label, keys in _COUNTERS:
            labels = [label.split("_")[0]] if label and label != "kind_state" else (["kind", "state"] if label else [])
            fam = CounterMetricFamily(f"tpcache_{suffix}", text, labels=labels)
            for value_label, key in keys.items():
                values = value_label.split("/") if label == "kind_state" else ([value_label] if label else [])
                fam.add_metric(values, float(stats.get(key, 0)))
            yield fam
        rounds = CounterMetricFamily("tpcache_rounds", "Rounds committed (one all-reduce each)")
        rounds.add_metric([], float(stats.get("rounds", 0)))
        yield rounds
        mism = CounterMetricFamily(
            "tpcache_mismatches", "Rounds in which a field disagreed, by field", labels=["field"]
        )
        for key, value in stats.items():
            if key.startswith("mismatches."):
                mism.add_metric([key.split(".", 1)[1]], float(value))
        yield mism
        closed = GaugeMetricFamily("tpcache_closed", "1 when the cache failed closed (serving misses), else 0")
        closed.add_metric([], 1.0 if health.get("state") == "closed" else 0.0)
        yield closed
        for name, key, text in (
            ("tpcache_device_pages_used", "device_pages_used", "Device pages in use"),
            ("tpcache_host_pages_used", "host_pages_used", "Host pages in use"),
            ("tpcache_leases", "leases", "Leases open"),
        ):
            g = GaugeMetricFamily(name, text)
            g.add_metric([], float(stats.get(key, 0)))
            yield g
        info = InfoMetricFamily("tpcache_transport", "The round transport and this rank's place in the group")
        info.add_metric(
            [],
            {
                "transport": str(health.get("transport", "")),
                "rank": str(self.m.rank),
                "world_size": str(health.get("world_size", "")),
            },
        )
        yield info
