"""Prometheus metrics and health of one rank, on its own CollectorRegistry (never the global one).

The rank's HTTP port serves ``/metrics`` (the Prometheus text format), ``/health`` (200 while the
cache is open, 503 with the reason while it is closed or the rank stops) and ``/ready`` (200 once
the rank serves, 503 while it starts or stops); any other path is 404.

The round loop (main thread) publishes a snapshot of the cache's counters at most every
``interval_s``; scrapes (the HTTP server's threads) read only that snapshot, so a scrape never
touches the cache while the main thread mutates it. Round latency and requests are recorded as
they happen, and storage counters are read from the backend (prometheus_client's own types and
the backends' counters are thread-safe). Every counter family counts one thing: no label mixes
issued with done, so a sum over any label is meaningful. docs/reference/metrics.md lists every metric.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

ROUND_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0)
TIERS = ("device", "host")

# Counters from the cache's stats: (name without tpcache_ and _total, help, label, {label value: stats key}).
COUNTERS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("lookup_tokens", "Tokens of full pages looked up by lock", "", {"": "lookup_tokens"}),
    (
        "hit_tokens",
        "Tokens served from the cache, by tier",
        "tier",
        {t: f"{t}_hit_tokens" for t in (*TIERS, "storage")},
    ),
    ("storage_lookups", "Lookups of a prefix's continuation in the storage tier", "", {"": "storage_lookups"}),
    ("inserted_pages", "Pages inserted", "", {"": "inserted_pages"}),
    ("evicted_pages", "Pages evicted, by tier", "tier", {t: f"{t}_evicted_pages" for t in TIERS}),
    (
        "transfer_issued_pages",
        "Pages whose copy between tiers was started, by kind (backup: device to host; load: host to device)",
        "kind",
        {"backup": "backups_issued_pages", "load": "loads_issued_pages"},
    ),
    (
        "transfer_done_pages",
        "Pages whose copy between tiers every rank agreed finished, by kind",
        "kind",
        {"backup": "backups_done_pages", "load": "loads_done_pages"},
    ),
    (
        "storage_write_issued_pages",
        "Pages whose write to the storage tier was started",
        "",
        {"": "storage_write_issued_pages"},
    ),
    (
        "storage_written_pages",
        "Pages every rank agreed are durable in the storage tier",
        "",
        {"": "storage_written_pages"},
    ),
    (
        "rejected_pages",
        "Pages a copy or write could not take, by reason",
        "reason",
        {
            "host_full": "backup_rejected_host_full",
            "copy_failed": "failed_copy_pages",
            "prefetch_host_full": "prefetch_rejected_host_full",
        },
    ),
    (
        "mirrors_released_pages",
        "Host mirrors of device pages released under host pressure",
        "",
        {"": "mirrors_released_pages"},
    ),
    (
        "prefetch_hit_pages",
        "Pages a storage prefetch found on every rank (the agreed hit)",
        "",
        {"": "prefetch_hit_pages"},
    ),
    ("prefetch_read_pages", "Pages a storage prefetch read into the host tier", "", {"": "prefetch_read_pages"}),
    (
        "staging_freed_pages",
        "Host staging slots (buffer host mode) freed once the copy they staged was agreed complete",
        "",
        {"": "staging_freed_pages"},
    ),
    ("admissions_committed", "Requests admitted in phases (commit)", "", {"": "admissions_committed"}),
    ("admission_retries", "Materialize answers 'try again' (the request stays queued)", "", {"": "admission_retries"}),
    (
        "admission_reselects",
        "Materializes that delivered fewer pages than planned (selected again without a staged hit)",
        "",
        {"": "admission_reselects"},
    ),
    (
        "admission_gave_up",
        "Requests admitted with their device hit after the deferral cap",
        "",
        {"": "admission_gave_up"},
    ),
    ("rounds", "Rounds committed (one all-reduce each)", "", {"": "rounds"}),
    (
        "client_connections_refused",
        "Client connections refused because max_connections were open (rank 0)",
        "",
        {"": "refused_connections"},
    ),
    (
        "client_connections_dropped",
        "Client connections closed because they left replies unread past max_unread_reply_bytes (rank 0)",
        "",
        {"": "dropped_connections"},
    ),
    (
        "unread_replies_refused",
        "Large replies refused OVERLOADED because max_unread_reply_bytes were held unread (rank 0)",
        "",
        {"": "refused_replies"},
    ),
)

# Counters from the storage backend's own stats (this rank's reads and writes, before agreement).
STORAGE_COUNTERS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("storage_reads", "Pages this rank asked its storage backend for", "", {"": "gets"}),
    ("storage_read_hits", "Pages this rank's storage backend returned, verified", "", {"": "hits"}),
    (
        "storage_read_misses",
        "Pages this rank's storage backend did not return, by reason",
        "reason",
        {
            r: f"misses_{r}"
            for r in ("missing", "short", "corrupt", "foreign", "io_error", "unauthenticated", "unusable")
        },
    ),
    ("storage_writes", "Pages this rank's storage backend wrote", "", {"": "put_ok"}),
    (
        "storage_write_failures",
        "Pages this rank's storage backend could not write, by reason",
        "reason",
        {r: f"put_failures_{r}" for r in ("no_space", "too_large", "io_error", "unusable")},
    ),
    ("storage_evictions", "Records the storage backend evicted to stay within its capacity", "", {"": "evictions"}),
    (
        "storage_direct_pages",
        "Pages the storage backend moved between the store and host memory without a staging copy",
        "op",
        {"read": "gets_direct", "write": "puts_direct"},
    ),
    (
        "storage_client_renewals",
        "Store clients the backend replaced after a failed read, so that no late transfer lands in host memory",
        "",
        {"": "client_renewals"},
    ),
)


# The KV-event stream's counters (rank 0's publisher; other ranks export 0), when events_endpoint is set:
# (name without tpcache_ and _total, help, stats key).
EVENT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("event_batches", "Event batches published", "event_batches"),
    ("event_stored_pages", "(page, tier) pairs published as stored", "event_pages_stored"),
    ("event_removed_pages", "(page, tier) pairs published as removed", "event_pages_removed"),
    ("event_published_bytes", "Bytes of event batches published (payloads on the events topic)", "event_bytes"),
    ("event_replays", "Replay requests the replay endpoint answered", "event_replays"),
    ("event_snapshots", "Snapshots the replay endpoint sent", "event_snapshots"),
    (
        "event_snapshots_refused",
        "Snapshots refused: more pages than events_snapshot_max_pages",
        "event_snapshots_refused",
    ),
    (
        "event_ring_dropped_batches",
        "Batches that left the replay ring (events_replay_batches or events_replay_mib)",
        "event_ring_dropped_batches",
    ),
)
EVENT_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("event_ring_batches", "Batches the replay ring holds", "event_ring_batches"),
    ("event_ring_bytes", "Bytes of batches the replay ring holds", "event_ring_bytes"),
)


class RankMetrics:
    """One rank's registry, its snapshot of the cache's state and its HTTP endpoint."""

    def __init__(
        self,
        rank: int,
        interval_s: float = 0.25,
        *,
        storage: Any = None,
        capacity: dict[str, int] | None = None,
        version: str = "",
        events: bool = False,
    ) -> None:
        """``events``: export the KV-event stream's families (events_endpoint is set)."""
        self.rank = rank
        self.events = events
        self.interval_s = interval_s
        self.storage = storage
        self.capacity = dict(capacity or {})
        self.version = version
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
        # The process's CPU, memory and file descriptors, the interpreter's GC and version.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._snapshot: dict[str, Any] = {}
        self._health: dict[str, Any] = {}
        self._last = 0.0
        self.phase = "starting"  # "serving" once the rank serves, "stopping" from its stop on
        self.registry.register(_SnapshotCollector(self))
        self.server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def observe_round(self, seconds: float, requests: int) -> None:
        self.round_seconds.observe(seconds)
        self.batch_requests.observe(requests)

    def publish(self, stats: dict[str, Any], health: dict[str, Any], force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._snapshot, self._health, self._last = stats, health, now

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    @property
    def ready(self) -> bool:
        return self.phase == "serving"

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 200 while the cache is open, 503 with the reason while
        it is closed, or while the rank starts or stops."""
        state = str(self._health.get("state", "open"))
        body = {"state": state, "reason": str(self._health.get("reason", "")), "rank": self.rank}
        body["round"] = int(self._health.get("round", 0))
        if state == "open" and self.phase != "serving":
            body.update(state=self.phase, reason=f"the rank is {self.phase}")
        return (200 if body["state"] == "open" else 503), body

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve /metrics, /health and /ready on ``addr:port`` from a daemon thread."""
        self.server = ThreadingHTTPServer((addr, port), _handler_for(self))
        self.server.daemon_threads = True
        # A short poll interval: close() waits for it, and a rank must stop within a second or two.
        self._thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name=f"metrics-{port}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.phase = "stopping"
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _handler_for(metrics: RankMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                status, body = metrics.health()
                self._send(status, json.dumps(body).encode() + b"\n", "application/json")
            elif path == "/ready":
                ready = metrics.ready
                self._send(200 if ready else 503, b"ready\n" if ready else b"not ready\n", "text/plain")
            else:
                self._send(404, b"not found: try /metrics, /health or /ready\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
            pass

    return Handler


def _counter(name: str, text: str, label: str, keys: dict[str, str], values: dict[str, Any]) -> CounterMetricFamily:
    fam = CounterMetricFamily(f"tpcache_{name}", text, labels=[label] if label else [])
    for label_value, key in keys.items():
        fam.add_metric([label_value] if label else [], float(values.get(key, 0) or 0))
    return fam


def _gauge(name: str, text: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, text, labels=list(labels or {}))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


class _SnapshotCollector:
    def __init__(self, metrics: RankMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats, health = self.m._snapshot, self.m._health
        for spec in COUNTERS:
            yield _counter(*spec, stats)
        mism = CounterMetricFamily(
            "tpcache_mismatches", "Rounds in which a field disagreed, by field", labels=["field"]
        )
        for key, value in stats.items():
            if key.startswith("mismatches."):
                mism.add_metric([key.split(".", 1)[1]], float(value))
        yield mism
        yield _gauge(
            "tpcache_closed",
            "1 when the cache failed closed (serving misses), else 0",
            float(health.get("state") == "closed"),
        )
        yield _gauge("tpcache_ready", "1 while this rank serves, else 0", float(self.m.ready))
        used = GaugeMetricFamily(
            "tpcache_pages_used", "Pages in use (owned by the cache or a lease), by tier", labels=["tier"]
        )
        total = GaugeMetricFamily("tpcache_pages_capacity", "Pages in the tier's pool, by tier", labels=["tier"])
        for tier in TIERS:
            used.add_metric([tier], float(stats.get(f"{tier}_pages_used", 0) or 0))
            total.add_metric([tier], float(self.m.capacity.get(tier, 0)))
        yield used
        yield total
        yield _gauge(
            "tpcache_staging_pages_used",
            "Host slots staging storage reads and writes (buffer host mode; not cached pages)",
            float(stats.get("host_staging_pages_used", 0) or 0),
        )
        yield _gauge(
            "tpcache_staging_pages_capacity",
            "Host slots for staging (buffer host mode; 0 in cache mode)",
            float(self.m.capacity.get("staging", 0)),
        )
        yield _gauge(
            "tpcache_unread_reply_bytes",
            "Reply bytes rank 0 holds for clients that have not read them (bounded by max_unread_reply_bytes)",
            float(stats.get("unread_reply_bytes", 0) or 0),
        )
        yield _gauge(
            "tpcache_leases", "Leases open (requests holding pins, pages or copies)", float(stats.get("leases", 0) or 0)
        )
        if self.m.storage is not None:
            store = self.m.storage.stats()
            for spec in STORAGE_COUNTERS:
                yield _counter(*spec, store)
            yield _gauge(
                "tpcache_storage_used_bytes",
                "Bytes the storage tier holds on this rank",
                float(store.get("bytes_used", 0)),
            )
            yield _gauge(
                "tpcache_storage_capacity_bytes",
                "Capacity of the storage tier on this rank",
                float(store.get("capacity_bytes", 0)),
            )
        if self.m.events:
            for name, text, key in EVENT_COUNTERS:
                yield _counter(name, text, "", {"": key}, stats)
            for name, text, key in EVENT_GAUGES:
                yield _gauge(f"tpcache_{name}", text, float(stats.get(key, 0) or 0))
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
        build = InfoMetricFamily("tpcache_build", "The tpcache version this rank runs")
        build.add_metric([], {"version": self.m.version})
        yield build
