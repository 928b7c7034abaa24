"""Apply one protocol request to this rank's TPCache.

Every rank runs the same requests in the same order through ``RankHandler.apply``; because the
core is deterministic, every rank computes the same result (or raises the same error), so the
leader's answer speaks for the group. Results that depend on the round (step, flush, stats) are
returned as a ``Deferred`` and finished after the batch's round committed.

Exceptions from the engine map to protocol errors: OutOfPages -> NO_SPACE, CacheClosed ->
CACHE_CLOSED, UnknownLease -> NOT_FOUND, ValueError -> BAD_ARGUMENT, anything else -> INTERNAL
(type name only, logged here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import protocol as p
from tpcache.core import CacheClosed as CoreClosed
from tpcache.core import OutOfPages, UnknownLease
from tpcache.core.round import RoundReport
from tpcache.engine import TPCache
from tpcache.service.buffers import KVBufferError, StagedBuffer, stage_buffer
from tpcache.service.config import ServiceConfig, format_kv_layout

log = logging.getLogger("tpcache.service")

SERVER_NAME = "tpcache 0.1.0"

# Ops every rank applies (sequenced, or needing a per-rank answer). The rest run on the leader only.
FANOUT_OPS = frozenset(
    ("lock", "alloc", "insert", "load", "release", "abort", "step", "flush", "set_config", "stats")
    + ("register_buffers", "put_pages", "get_pages")
)
# Ops whose reply waits for every rank's own answer (sent back over the internal channel).
GATHER_OPS = frozenset(("stats", "register_buffers", "put_pages", "get_pages"))


@dataclass
class Deferred:
    """A result finished after the round that covers the request committed."""

    finish: Callable[[RoundReport], p.Body]


def to_protocol_error(exc: BaseException) -> p.ProtocolError:
    if isinstance(exc, p.ProtocolError):
        return exc
    if isinstance(exc, OutOfPages):
        return p.NoSpace(f"no free device pages: {exc}")
    if isinstance(exc, CoreClosed):
        return p.CacheClosed(str(exc))
    if isinstance(exc, UnknownLease):
        return p.NotFound(str(exc.args[0]) if exc.args else "unknown lease")
    if isinstance(exc, ValueError):
        return p.InvalidArgument(str(exc))
    log.exception("internal error while applying a request", exc_info=exc)
    return p.InternalError(f"internal error ({type(exc).__name__})")


def layout_descriptor(tp: TPCache) -> str:
    """The layout as --kv-layout takes it (``L32xH8xD128:bf16``); hello carries the page size."""
    return "metadata" if tp.kv_layout is None else format_kv_layout(tp.kv_layout)


class RankHandler:
    """One rank's request executor. ``tp`` may be rebuilt by a buffer registration."""

    def __init__(self, tp: TPCache, config: ServiceConfig, make_cache: Callable[[Any], TPCache]) -> None:
        self.tp = tp
        self.config = config
        self.make_cache = make_cache  # device pool (or None) -> a new TPCache on the same collective
        self.staged: dict[int, StagedBuffer] = {}
        self.active_buffer: StagedBuffer | None = None

    @property
    def rank(self) -> int:
        return self.tp.rank

    # ------------------------------------------------------------------ checks before sequencing

    def precheck(self, body: p.Body) -> None:
        """Refuse, on the leader and before sequencing, requests every rank would refuse alike."""
        ns = getattr(body, "namespace", "")
        if ns and ns != self.config.namespace:
            raise p.InvalidArgument(f"this server serves namespace {self.config.namespace!r}, not {ns!r}")
        if isinstance(body, p.InsertRequest) and body.lease is None:
            raise p.InvalidArgument("insert needs a lease (lock, then alloc pages under it)")
        if isinstance(body, p.SetConfigRequest) and (
            body.mirror_release is not None or body.storage_prefetch is not None
        ):
            raise p.InvalidArgument("only retention_cap_tokens can be changed at runtime by this server")
        if isinstance(body, (p.PutPagesRequest, p.GetPagesRequest)) and self.tp.device_pool is None:
            raise p.InvalidArgument("this cache is metadata only: start it with --kv-layout or register buffers")
        if isinstance(body, p.RegisterBuffersRequest):
            ranks = [d.get("rank") for d in body.descriptors]
            if sorted(r for r in ranks if type(r) is int) != list(range(self.tp.world_size)):
                raise p.InvalidArgument(
                    f"register_buffers needs exactly one descriptor per rank 0..{self.tp.world_size - 1}"
                )

    # ------------------------------------------------------------------ apply

    def apply(self, body: p.Body, token: int) -> p.Body | Deferred:
        """Run ``body`` on this rank. ``token`` names the request (its sequence number) for
        two-phase operations. Raises ProtocolError."""
        try:
            return self._apply(body, token)
        except Exception as exc:  # mapped: every rank raises alike, the leader replies with it
            raise to_protocol_error(exc) from None

    def _apply(self, body: p.Body, token: int) -> p.Body | Deferred:
        tp = self.tp
        ps = tp.config.page_size
        # Match and lock results come from this rank's own tree (counts and page numbers it
        # allocated), so they skip the per-field checks a client's input gets.
        if isinstance(body, p.MatchRequest):
            m = tp.match(body.tokens)
            hit = (m.device_pages + m.host_pages) * ps
            return p.MatchResult.unchecked(hit, m.device_pages, m.host_pages, 0, m.device_page_array)
        if isinstance(body, p.LockRequest):
            lease, m = tp.lock(body.tokens)
            hit = (m.device_pages + m.host_pages) * ps
            return p.LockResult.unchecked(lease, hit, m.device_pages, m.host_pages, 0, m.device_page_array)
        if isinstance(body, p.AllocRequest):
            return p.AllocResult(tp.alloc(body.lease, body.num_pages))
        if isinstance(body, p.InsertRequest):
            inserted, dup = tp.insert(body.lease, body.tokens, body.device_page_ids)
            return p.InsertResult(inserted, dup)
        if isinstance(body, p.LoadRequest):
            return p.LoadResult(tp.load(body.lease).device_pages)
        if isinstance(body, p.ReleaseRequest):
            tp.release(body.lease)
            return p.ReleaseResult()
        if isinstance(body, p.AbortRequest):
            tp.release(body.lease)  # pages allocated and not inserted go back with the lease
            return p.AbortResult()
        if isinstance(body, p.StepRequest):
            return Deferred(lambda report: p.StepResult(report.round))
        if isinstance(body, p.FlushRequest):
            tp.request_flush()
            return Deferred(lambda report: p.FlushResult(report.round))
        if isinstance(body, p.SetConfigRequest):
            if body.retention_cap_tokens is not None:
                tp.set_retention_cap(body.retention_cap_tokens)
            return p.SetConfigResult(self.settings())
        if isinstance(body, p.StatsRequest):
            return Deferred(lambda report: p.StatsResult(self.stats_values()))
        if isinstance(body, p.HealthRequest):
            h = tp.health()
            return p.HealthResult(h["state"], h["reason"], h["round"])
        if isinstance(body, p.HelloRequest):
            return self.hello()
        if isinstance(body, p.RegisterBuffersRequest):
            return self._stage(body, token)
        if isinstance(body, p.PutPagesRequest):
            return self._put_pages(body)
        if isinstance(body, p.GetPagesRequest):
            return self._get_pages(body)
        raise p.UnknownOp(f"op {body.OP!r} is not served")

    def hello(self) -> p.HelloResult:
        return p.HelloResult(
            p.PROTOCOL_VERSION,
            SERVER_NAME,
            self.tp.world_size,
            self.tp.config.page_size,
            layout_descriptor(self.tp),
            p.DEFAULT_LIMITS.max_message_bytes,
        )

    def settings(self) -> dict[str, Any]:
        c = self.tp.config
        return {
            "retention_cap_tokens": self.tp.core.retention_cap_tokens,
            "mirror_release": c.mirror_release,
            "storage_prefetch": False,
            "write_policy": c.write_policy,
            "page_size": c.page_size,
            "device_pages": c.device_pages,
            "host_pages": c.host_pages,
        }

    def stats_values(self) -> dict[str, Any]:
        """This rank's counters as a flat map of scalars (nested maps flattened with dots)."""
        out: dict[str, Any] = {}
        for key, value in self.tp.stats().items():
            if isinstance(value, dict):
                for k, v in value.items():
                    out[f"{key}.{k}"] = v
            elif value is None or isinstance(value, (bool, int, float, str)):
                out[key] = value
        out["rank"] = self.rank
        out["world_size"] = self.tp.world_size
        out["transport"] = self.tp.collective.name
        out["layout"] = layout_descriptor(self.tp)
        recent = sorted(self.tp.round_seconds)  # the last rounds only (the engine keeps 4,096)
        if recent:
            out["round_p50_us"] = round(recent[len(recent) // 2] * 1e6, 1)
            out["round_p99_us"] = round(recent[min(len(recent) - 1, int(len(recent) * 0.99))] * 1e6, 1)
        return out

    # ------------------------------------------------------------------ data plane

    def _stage(self, body: p.RegisterBuffersRequest, token: int) -> p.Body:
        mine = [d for d in body.descriptors if d.get("rank") == self.rank]
        if len(mine) != 1:
            raise p.InvalidArgument(f"expected one descriptor for rank {self.rank}, got {len(mine)}")
        if self.tp.kv_layout is None:
            raise p.InvalidArgument("registering buffers needs a KV layout: start the service with --kv-layout")
        try:
            self.staged[token] = stage_buffer(mine[0], self.tp.kv_layout, self.tp.config.device_pages)
        except KVBufferError as exc:
            raise p.InvalidArgument(f"rank {self.rank}: {exc}") from None
        return p.RegisterBuffersResult(len(body.descriptors))

    def activate(self, token: int, commit: bool) -> p.Body:
        """Second phase of register_buffers, run by every rank at the same point of the sequence:
        swap in the staged buffer (commit) or drop it. Raises ProtocolError when the cache holds
        anything (pages in the old pool would be lost), identically on every rank."""
        staged = self.staged.pop(token, None)
        if not commit:
            if staged is not None:
                staged.close()
            return p.RegisterBuffersResult(0)
        core = self.tp.core
        if core.leases or len(core.tree.nodes) > 1 or any(core.inflight.values()):
            if staged is not None:
                staged.close()
            raise p.InvalidArgument("register buffers before the first insert: the cache is not empty")
        if staged is None:
            raise p.InternalError(f"rank {self.rank} lost its staged buffer")
        old, old_buffer = self.tp, self.active_buffer
        self.tp = self.make_cache(staged.pool)
        self.active_buffer = staged
        old.shell.close()  # the collective lives on in the new cache
        if old_buffer is not None:
            old_buffer.close()
        return p.RegisterBuffersResult(self.tp.world_size)  # one buffer per rank, all swapped in

    def _pages(self, page_ids: Any) -> list[int]:
        pool = self.tp.device_pool
        assert pool is not None
        pages = list(page_ids)
        pool.check_pages(pages, "page_ids")
        return pages

    def _put_pages(self, body: p.PutPagesRequest) -> p.Body:
        """``data`` holds every rank's share, rank-major; each share is its pages in order."""
        pool = self.tp.device_pool
        if pool is None:
            raise p.InvalidArgument("this cache is metadata only")
        pages = self._pages(body.page_ids)
        size = pool.layout.page_bytes
        world = self.tp.world_size
        if len(body.data) != size * len(pages) * world:
            raise p.InvalidArgument(
                f"put_pages: {len(body.data)} bytes; {world} rank shares of {len(pages)} pages of {size} bytes "
                f"need {size * len(pages) * world}"
            )
        share = size * len(pages)
        view = memoryview(body.data)[self.rank * share : (self.rank + 1) * share]
        for i, page in enumerate(pages):
            pool.write_page(page, view[i * size : (i + 1) * size])
        return p.PutPagesResult(len(pages))

    def _get_pages(self, body: p.GetPagesRequest) -> p.Body:
        """This rank's share; the leader joins every rank's, rank-major (as put_pages takes them)."""
        pool = self.tp.device_pool
        if pool is None:
            raise p.InvalidArgument("this cache is metadata only")
        pages = self._pages(body.page_ids)
        size = pool.layout.page_bytes * len(pages) * self.tp.world_size
        if size > p.DEFAULT_LIMITS.max_inline_bytes:
            raise p.MessageTooLarge(f"get_pages: {size} bytes, more than {p.DEFAULT_LIMITS.max_inline_bytes}")
        return p.GetPagesResult(b"".join(pool.read_page(page).numpy().tobytes() for page in pages))

    # ------------------------------------------------------------------ per-rank answers

    def rank_payload(self, body: p.Body, outcome: p.Body | p.ProtocolError) -> dict[str, Any]:
        """What this rank sends the leader for a GATHER_OPS request (small scalars only)."""
        if isinstance(outcome, p.ProtocolError):
            return {"error": int(outcome.code), "message": outcome.message[:512]}
        if isinstance(outcome, p.StatsResult):
            return {"values": dict(outcome.values)}
        if isinstance(outcome, p.GetPagesResult):
            return {"data": outcome.data}
        return {}

    def close(self) -> None:
        for staged in self.staged.values():
            staged.close()
        self.staged.clear()
        self.tp.close()
        if self.active_buffer is not None:
            self.active_buffer.close()
            self.active_buffer = None
