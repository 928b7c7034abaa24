"""One rank's request executor: the cache it serves, the leases it handed out, its settings.

``RankHandler.apply`` runs a request through its op's handler (``ops.py``); the helpers here are
what those handlers share (lease ownership, storage prefetch, page checks, the data plane's
buffer swap). ``tp`` may be rebuilt by a buffer registration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import protocol as p
from tpcache.core import UnknownLease
from tpcache.engine import TPCache
from tpcache.service.buffers import StagedBuffer
from tpcache.service.config import ServiceConfig, format_kv_layout
from tpcache.service.leases import LeaseBook, not_found
from tpcache.service.ops import OPS, Ctx, Found, Watch, to_protocol_error

log = logging.getLogger("tpcache.service")

SERVER_NAME = "tpcache 0.1.0"


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
        self.service_counters: dict[str, int] = {}  # the service loop's own counts, shown in stats
        self.book = LeaseBook(config.max_leases_per_client, config.max_leases)
        self.storage_prefetch = config.storage_prefetch and tp.config.storage  # set_config changes it

    @property
    def rank(self) -> int:
        return self.tp.rank

    # ------------------------------------------------------------------ checks before sequencing

    def precheck(self, body: p.Body) -> None:
        """Refuse, on the leader and before sequencing, requests every rank would refuse alike."""
        ns = getattr(body, "namespace", "")
        if ns and ns != self.config.namespace:
            raise p.InvalidArgument(f"this server serves namespace {self.config.namespace!r}, not {ns!r}")
        op = OPS.get(body.OP)
        if op is not None and op.precheck is not None:
            op.precheck(self, body)

    # ------------------------------------------------------------------ apply

    def apply(self, body: p.Body, ctx: Ctx) -> Any:
        """Run ``body`` on this rank: its op's handler's result (a Body, or a Deferred finished
        after the round). Raises ProtocolError."""
        op = OPS.get(body.OP)
        if op is None:
            raise p.UnknownOp(f"op {body.OP!r} is not served")
        try:
            return op.apply(self, body, ctx)
        except Exception as exc:  # mapped: every rank raises alike, the leader replies with it
            raise to_protocol_error(exc) from None

    def lookup(self, tokens: bytes) -> Found:
        """``apply`` of a plain match request (no storage lookup: rank 0 alone answers it), its
        tokens as their wire bytes: what the reply needs of the cache's match (``ops.Found``, from
        ``tpcache.core.treecore.lookup``, which lists no node it found). Raises ProtocolError."""
        try:
            return self.tp.lookup(tokens)
        except Exception as exc:  # mapped as apply maps it
            raise to_protocol_error(exc) from None

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
        round_ = self.tp.round
        mirror = any(f.name == "mirror_release" for f in round_.features) and "mirror_release" not in round_.disabled
        return {
            "retention_cap_tokens": self.tp.core.retention_cap_tokens,
            "mirror_release": mirror,
            "storage_prefetch": self.storage_prefetch,
            "storage": c.storage,
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
        out.update(self.service_counters)
        # What prefetches found in storage (agreed, before anything loads); ``storage_hit_tokens`` is
        # the core's: tokens a committed admission actually took from storage.
        out["storage_prefetch_hit_tokens"] = out.get("prefetch_hit_pages", 0) * self.tp.config.page_size
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

    def activate(self, token: int, commit: bool) -> p.Body:
        """Second phase of register_buffers, run by every rank at the same point of the sequence:
        swap in the staged buffer (commit) or drop it. Raises ProtocolError when the cache holds
        anything (pages in the old pool would be lost), identically on every rank."""
        staged = self.staged.pop(token, None)
        if not commit:
            if staged is not None:
                staged.close()
            return p.RegisterBuffersResult(0)
        if not self.tp.core.is_empty():
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

    def pages(self, page_ids: Any) -> list[int]:
        pool = self.tp.device_pool
        if pool is None:
            raise p.InvalidArgument("this cache is metadata only")
        pages = list(page_ids)
        pool.check_pages(pages, "page_ids")
        return pages

    def leased(self, lease: int, ctx: Ctx) -> None:
        """NOT_FOUND unless ``ctx``'s connection owns ``lease``."""
        self.book.check(lease, ctx.conn)

    def lease_pages(self, lease: int, ctx: Ctx) -> tuple[int, ...]:
        """The device pages ``lease`` allocated and still holds, if ``ctx``'s connection owns it; else
        NOT_FOUND."""
        self.book.check(lease, ctx.conn)
        return self.tp.core.lease_pages(lease)

    def expire(self, leases: list[int]) -> None:
        """Release leases the leader found abandoned (their connection left, or they sat idle past
        the TTL); a lease already released meanwhile is skipped. Every rank alike."""
        expired = 0
        for lease in leases:
            if self.book.drop(lease) is not None:
                expired += 1
                try:
                    self.tp.release(lease)
                except UnknownLease:
                    log.error("rank %d: lease %d was in the book but not in the cache", self.rank, lease)
        self.service_counters["expired_leases"] = self.service_counters.get("expired_leases", 0) + expired

    def watched(self, watch: Watch, now: bool = False) -> p.Body | None:
        """The reply of ``watch`` once its prefetch lets it go (or ``now``: with what is agreed so
        far), else None. Reads only agreed state: a prefetch moves only by agreed completions and
        the round count."""
        lease = watch.lease
        if lease not in self.book:
            raise not_found(lease)  # released or expired while it waited
        if watch.load is not None:
            if not now and self.loading(lease):
                return None
            return watch.reply(self.landed(lease, watch.load))
        status, ready = self.tp.prefetch_status(lease)
        if status == "none":
            return watch.reply("none", 0, 0, "")
        waiting = status == "querying" and watch.policy != "timeout"  # the hit is not agreed yet
        if not now and (waiting or not self.tp.admissible(lease, watch.policy, watch.timeout_rounds)):
            return None
        state = self.tp.core.prefetch_progress(lease)
        assert state is not None
        # The agreed storage hit, from where the first lookup started (a retry asks from where the
        # pages that landed end), and why the pages read to host fall short of it.
        hit = max(ready, state.start + state.hit_pages - watch.base) if state.hit_pages else ready
        return watch.reply("done" if status == "done" else "running", hit, ready, self.shortfall(state, hit, ready))

    def shortfall(self, state: Any, hit: int, ready: int) -> str:
        """Why ``ready`` of a prefetch's ``hit`` storage pages landed in host, not all (``STORAGE_REASONS``)."""
        if ready >= hit:
            return ""
        if self.tp.core.closed:
            return "closed"
        if state.status != "done":
            return "reading"
        buffer = self.tp.config.host_mode == "buffer"  # staging reads the part the free slots take
        if buffer or state.deferrals >= self.tp.config.prefetch_max_deferrals:
            return "no_host_space"
        return "read_failed"

    def loading(self, lease: int) -> bool:
        """Whether a load the lease waits for (its own, or one it shares) is still in flight."""
        return self.tp.core.lease_loading(lease)

    def landed(self, lease: int, pages: list[int]) -> list[int]:
        """The leading ``pages`` (a load's, in the lease's page order) that are device-valid now."""
        valid = self.tp.core.device_valid_prefix(lease, len(pages))
        n = 0
        while n < len(valid) and valid[n] == pages[n]:
            n += 1
        return pages[:n]

    def start_prefetch(self, lease: int, read: bool = True) -> bool:
        started = self.tp.prefetch(lease, read)
        if started:
            self.service_counters["storage_lookups"] = self.service_counters.get("storage_lookups", 0) + 1
        return started

    def reply_bytes(self, body: p.Body) -> int:
        """The bytes a reply to ``body`` will carry when that is more than a few KiB (inline pages)."""
        op = OPS.get(body.OP)
        return 0 if op is None or op.reply_bytes is None else op.reply_bytes(self, body)

    def valid_pages(self) -> set[int]:
        """Device pages that hold agreed cached KV (VALID in the tree)."""
        return self.tp.core.valid_device_pages()

    def close(self) -> None:
        for staged in self.staged.values():
            staged.close()
        self.staged.clear()
        self.tp.close()
        if self.active_buffer is not None:
            self.active_buffer.close()
            self.active_buffer = None
