"""TPCache: one cache rank, embedded in an engine's TP worker or run by the service.

Every rank of the TP group calls the same sequenced operations in the same order (an engine's TP
workers do by construction; the service's ranks do because rank 0 orders the requests), then
``step()`` once per scheduler step. ``step`` is the round: exactly one all-reduce, issued
unconditionally by every rank from the calling (main) thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from protocol.round_vector import HEALTH_TRANSFER_ERROR
from tpcache.core import CacheConfig, CacheCore, MatchResult
from tpcache.core.hashing import TokenIds
from tpcache.core.round import Round, RoundReport
from tpcache.dist.collective import Collective, CollectiveError
from tpcache.engine.shell import Shell, storage_key_factory
from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout
from tpcache.io.storage import StorageBackend, StorageWorker
from tpcache.io.transfer import LoadHandle, TransferEngine

log = logging.getLogger("tpcache.engine")

KV_FORMAT_VERSION = 1


def layout_version(layout: KVLayout) -> int:
    """A stable id of the page byte format: storage never reads pages written in another layout."""
    fields = (KV_FORMAT_VERSION, layout.num_layers, layout.heads_per_rank, layout.head_dim, layout.dtype)
    desc = "/".join(str(f) for f in (*fields, layout.page_size))
    return xxhash.xxh32_intdigest(desc.encode()) & 0x7FFFFFFF


@dataclass
class LoadResult:
    device_pages: list[int]  # the lease's device prefix, loading pages included
    handles: list[LoadHandle]  # every load its pages wait for: its own, and others' it shares

    @property
    def handle(self) -> LoadHandle | None:
        """The latest load the prefix waits for (None when nothing is loading)."""
        return self.handles[-1] if self.handles else None

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of every page of the prefix has landed (a forward pass's layer i)."""
        for handle in self.handles:
            handle.wait_layer(layer, timeout)


class TPCache:
    def __init__(
        self,
        config: CacheConfig,
        collective: Collective,
        *,
        kv_layout: KVLayout | None = None,
        device_pool: DevicePool | None = None,
        host_layout: str = "page_first",
        device: Any = None,
        storage: StorageBackend | None = None,
        round_timeout_s: float = 30.0,
        transfer_threads: int | None = 1,
        transfer_delay: Any = None,
    ) -> None:
        """``transfer_delay``: test hook passed to the TransferEngine (seconds, or op id -> seconds)."""
        if storage is not None and not config.storage:
            config = CacheConfig(**{**config.to_dict(), "storage": True})
        if config.storage and storage is None:
            raise ValueError("config.storage is set but no storage backend was given")
        self.config = config
        self.collective = collective
        self.rank = collective.rank
        self.world_size = collective.world_size
        self.round_timeout_s = round_timeout_s
        self.core = CacheCore(config)
        self.round = Round(self.core)
        self.seq = 0
        self.round_seconds: list[float] = []  # recent round wall times (metrics only)
        self.kv_layout = kv_layout
        self.device_pool = device_pool
        self.host_pool: HostPool | None = None
        transfer = worker = key_of = None
        if kv_layout is not None:
            if kv_layout.page_size != config.page_size:
                raise ValueError(f"KV layout page size {kv_layout.page_size} != cache page size {config.page_size}")
            if self.device_pool is None:
                self.device_pool = DevicePool(kv_layout, config.device_pages, device)
            if self.device_pool.num_pages < config.device_pages:
                raise ValueError(
                    f"device pool has {self.device_pool.num_pages} pages, config needs {config.device_pages}"
                )
            self.host_pool = HostPool(kv_layout, max(config.host_pages, 1), host_layout)
            transfer = TransferEngine(self.device_pool, self.host_pool, threads=transfer_threads, delay=transfer_delay)
            if storage is not None:
                worker = StorageWorker(storage)
                key_of = storage_key_factory(config.namespace, layout_version(kv_layout), self.rank, self.world_size)
        elif storage is not None:
            raise ValueError("the storage tier needs a KV layout (pages have bytes to store)")
        self.storage = storage  # owned: closed with the cache
        self.shell = Shell(transfer, self.host_pool, worker, key_of)

    # ------------------------------------------------------------------ sequenced operations

    def lock(self, tokens: TokenIds) -> tuple[int, MatchResult]:
        """Match and pin the cached prefix for a request; returns (lease id, match)."""
        return self._sequenced(self.core.lock, tokens)

    def alloc(self, lease: int, num_pages: int) -> list[int]:
        """Device pages for the lease to compute KV into (evicting unpinned cache pages)."""
        return self._sequenced(self.core.alloc, lease, num_pages)

    def insert(self, lease: int, tokens: TokenIds, device_pages: Sequence[int]) -> tuple[int, int]:
        """Cache the full pages of ``tokens`` whose KV is in ``device_pages``."""
        return self._sequenced(self.core.insert, lease, tokens, list(device_pages))

    def load(self, lease: int) -> LoadResult:
        """Start loading the lease's host hits to device; wait per layer on ``handle``."""
        pages = self._sequenced(self.core.load, lease)
        handles = self.shell.handles
        return LoadResult(pages, [handles[op] for op in self.core.lease(lease).ops if op in handles])

    def prefetch(self, lease: int, read: bool = True) -> bool:
        """Look the continuation of the lease's tokens up in storage; read the agreed hit to host
        (seed 003; ``read=False``: only agree on the hit). Follow with ``prefetch_status``/
        ``admissible``, then ``load``."""
        return self._sequenced(self.core.prefetch, lease, read)

    def prefetch_status(self, lease: int) -> tuple[str, int]:
        return self.core.prefetch_status(lease)

    def admissible(self, lease: int, policy: str = "best_effort", timeout_rounds: int = 8) -> bool:
        """Whether to admit the lease's request now under the prefetch stop policy (pure, agreed state)."""
        return self.core.admissible(lease, policy, timeout_rounds)

    def release(self, lease: int) -> bool:
        """Finish or abort a request. Parked until copies into its pages land (seed 004)."""
        return self._sequenced(self.core.release, lease)

    def set_retention_cap(self, tokens: int) -> None:
        self._sequenced(self.core.set_retention_cap, tokens)

    def set_mirror_release(self, enabled: bool) -> None:
        """Switch mirror release (seed 002) on or off; sequenced, so every rank switches at once."""
        self._sequenced(self.round.set_feature, "mirror_release", enabled)

    def request_flush(self) -> None:
        self._sequenced(self.core.request_flush)

    def match(self, tokens: TokenIds) -> MatchResult:
        """A pure lookup (not sequenced; changes nothing)."""
        return self.core.match(tokens)

    def _sequenced(self, fn: Any, *args: Any) -> Any:
        self.seq += 1  # counted even when the op raises: every rank raises alike
        try:
            return fn(*args)
        finally:
            self.shell.submit(self.core.take_effects())

    # ------------------------------------------------------------------ the round

    def step(self) -> RoundReport:
        """One round: poll local completions, prepare, one all-reduce, commit.

        The collective is issued whatever happens locally: a rank that fails to prepare sends a
        vector that reports itself unhealthy, so its peers close with it instead of waiting."""
        start = time.perf_counter()
        try:
            self.shell.poll()
            vector = self.round.prepare(self.seq, self.shell)
        except Exception as exc:  # noqa: BLE001 - any local failure must still reach the round
            log.exception("round %d: preparing failed on rank %d", self.round.number, self.rank)
            self.core.close(f"rank {self.rank} could not prepare round {self.round.number}: {exc}")
            vector = self.round.poison_vector(self.seq)
        try:
            reduced = self.collective.allreduce_min(vector, self.round_timeout_s)
        except CollectiveError as exc:
            number = self.round.number
            self.round.fail(f"round {number}: the collective failed: {exc}")
            return RoundReport(round=number, closed_reason=self.core.closed_reason)
        try:
            report = self.round.commit(reduced)
        except Exception as exc:  # noqa: BLE001 - a commit that breaks midway must not serve again
            log.exception("round %d: commit failed on rank %d", self.round.number, self.rank)
            self.core.close(f"rank {self.rank} failed to commit: {exc}")
            self.shell.health_bits |= HEALTH_TRANSFER_ERROR  # the next round closes every rank
            return RoundReport(round=self.round.number, closed_reason=self.core.closed_reason)
        self.shell.retire(report.completed)
        if report.flushed:
            # Every rank starts over together: requests are counted afresh, so ranks whose counts
            # had diverged (the usual reason for a flush) agree again.
            self.shell.reset()
            self.seq = 0
        self.shell.submit(self.core.take_effects())
        self.round_seconds.append(time.perf_counter() - start)
        del self.round_seconds[:-4096]
        return report

    def drain(self, max_rounds: int = 10_000, pause_s: float = 0.0005) -> int:
        """Run rounds until nothing is in flight on any rank (a collective call: all ranks)."""
        for n in range(max_rounds):
            if not any(self.core.inflight.values()) or self.core.closed and self.shell.drained():
                return n
            self.step()
            if pause_s:
                time.sleep(pause_s)
        raise TimeoutError(f"copies still in flight after {max_rounds} rounds")

    # ------------------------------------------------------------------ introspection

    def health(self) -> dict[str, Any]:
        return {
            "state": "closed" if self.core.closed else "open",
            "reason": self.core.closed_reason or "",
            "round": self.round.number,
            "rank": self.rank,
            "world_size": self.world_size,
            "transport": self.collective.name,
            "disabled_features": sorted(self.round.disabled),
        }

    def stats(self) -> dict[str, Any]:
        core = self.core
        out: dict[str, Any] = dict(vars(core.stats))
        out.update(
            rounds=self.round.number,
            seq=self.seq,
            digest=core.digest.value,
            device_pages_used=core.device.used,
            host_pages_used=core.host.used,
            evictable_device_tokens=core.evictable_device_tokens,
            protected_device_tokens=core.protected_device_tokens,
            retention_cap_tokens=core.retention_cap_tokens,
            leases=len(core.leases),
            storage_start_errors=self.shell.storage_errors,
            closed=int(core.closed),
            mismatches=dict(self.round.mismatch_counts),
        )
        return out

    def close(self) -> None:
        self.shell.close()
        if self.storage is not None:
            self.storage.close()
        self.collective.close()
