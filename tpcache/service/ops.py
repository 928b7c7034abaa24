"""How each op is served: one handler per op, registered with ``@handles``.

Every rank runs the same requests in the same order through ``RankHandler.apply``, which calls
the op's handler here; because the core is deterministic, every rank computes the same result
(or raises the same error), so the leader's answer speaks for the group. A handler returns a
result body, a ``Deferred`` finished after the batch's round committed (step, flush, stats), or a
``Watch`` the leader answers once a storage prefetch lets it go.

What the group sequences is data throughout: the request itself (a batch entry), and the engine's
ops a handler applies for it (``tpcache.engine.sequenced.Op``). The callables here (handlers,
``Deferred.finish``, ``Watch.reply``) only shape a rank's outcome into a reply; none enters the
sequence.

Adding an op: declare its request and result bodies (and its route) in protocol/messages.py, and
write its handler here, with the hooks it needs (``Op``): a ``precheck`` that refuses before
sequencing, the size of a large reply, and for a gathered op what a follower sends back
(``payload``) and how the leader joins the answers (``merge``).

Exceptions from the engine map to protocol errors: OutOfPages -> NO_SPACE, CacheClosed ->
CACHE_CLOSED, UnknownLease -> NOT_FOUND, ValueError -> BAD_ARGUMENT, anything else -> INTERNAL
(type name only, logged here).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import protocol as p
from tpcache.core import CacheClosed as CoreClosed
from tpcache.core import OutOfPages, UnknownLease
from tpcache.core.round import RoundReport
from tpcache.service.buffers import KVBufferError, stage_buffer
from tpcache.service.leases import LEADER, LeaseBook

if TYPE_CHECKING:
    from tpcache.engine import TPCache
    from tpcache.service.buffers import StagedBuffer

log = logging.getLogger("tpcache.service")


class RankHandler(Protocol):
    """What an op reads from its rank (``handlers.RankHandler`` implements it): the cache, the
    lease book, staged buffers and the views the replies are built from."""

    tp: TPCache
    book: LeaseBook
    staged: dict[int, StagedBuffer]
    storage_prefetch: bool

    @property
    def rank(self) -> int: ...
    def hello(self) -> p.HelloResult: ...
    def settings(self) -> dict[str, Any]: ...
    def stats_values(self) -> dict[str, Any]: ...
    def pages(self, page_ids: Any) -> list[int]: ...
    def leased(self, lease: int, ctx: Ctx) -> None: ...
    def lease_pages(self, lease: int, ctx: Ctx) -> tuple[int, ...]: ...
    def start_prefetch(self, lease: int, read: bool = True) -> bool: ...
    def valid_pages(self) -> set[int]: ...


@dataclass
class Deferred:
    """A result finished after the round that covers the request committed."""

    finish: Callable[[RoundReport], p.Body]


@dataclass
class Watch:
    """A reply that waits on the leader, round after round, until the lease's storage prefetch
    lets it go, or (``load``) until the lease's loads landed (``RankHandler.watched``). Followers
    apply the request and drop the watch."""

    lease: int
    policy: str
    timeout_rounds: int
    # (status, storage pages, pages landed in host, why not all of them) -> the result; a load's
    # reply takes the pages that landed
    reply: Callable[..., p.Body]
    transient: bool = False  # a lease taken for this lookup alone: the leader expires it after the reply
    base: int = 0  # the page the prefetch's first lookup started at: its storage pages count from there
    load: list[int] | None = None  # a load's device pages: the reply lists those that landed


@dataclass(frozen=True, slots=True)
class Ctx:
    """What a handler knows of its request besides the body: identical on every rank."""

    token: int  # the request's sequence number (0: answered by the leader alone)
    conn: int  # the connection that sent it


@dataclass(frozen=True)
class Op:
    """How one op is served. ``apply`` runs on every rank the op's route reaches. ``precheck``
    (rank 0, before sequencing) refuses what every rank would refuse alike; ``reply_bytes``
    names a large reply's size before the request runs (for the per-client bound). A gathered op
    also has ``payload`` (a follower's outcome -> the small map it sends the leader) and ``merge``
    (the leader's outcome and every follower's map -> the reply)."""

    apply: Callable[[RankHandler, Any, Ctx], Any]
    precheck: Callable[[RankHandler, Any], None] | None = None
    reply_bytes: Callable[[RankHandler, Any], int] | None = None
    payload: Callable[[Any], dict[str, Any]] | None = None
    merge: Callable[[Any, dict[int, dict[str, Any]]], Any] | None = None


OPS: dict[str, Op] = {}


def handles(body_type: type[p.Body], **hooks: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the handler of ``body_type``'s op."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if body_type.OP in OPS:
            raise ValueError(f"op {body_type.OP!r} has two handlers")
        OPS[body_type.OP] = Op(fn, **hooks)
        return fn

    return decorate


def to_protocol_error(exc: BaseException) -> p.ProtocolError:
    if isinstance(exc, p.ProtocolError):
        return exc.with_traceback(None)  # kept as an outcome: its frames would keep the whole batch
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


def error_payload(outcome: Any) -> dict[str, Any] | None:
    """A follower's answer for a failed gathered op, or None when it succeeded."""
    if isinstance(outcome, p.ProtocolError):
        return {"error": int(outcome.code), "message": outcome.message[:512]}
    return None


def first_failure(answers: dict[int, dict[str, Any]]) -> p.ProtocolError | None:
    """The error of the lowest rank whose answer is one (the leader's reply for the group)."""
    for rank in sorted(answers):
        answer = answers[rank]
        if "error" in answer:
            return p.exception_for(answer["error"], f"rank {rank}: {answer.get('message', '')}")
    return None


def _needs_storage(h: RankHandler) -> None:
    if not h.tp.config.storage:
        raise p.InvalidArgument("this server has no storage tier (start it with --storage-dir)")


def _needs_pages(h: RankHandler) -> None:
    if h.tp.device_pool is None:
        raise p.InvalidArgument("this cache is metadata only: start it with --kv-layout or register buffers")


# ---------------------------------------------------------------------------------------------
# The handlers, one per op. Match and lock results come from this rank's own tree (counts and
# page numbers it allocated), so they skip the per-field checks a client's input gets.


@handles(p.HelloRequest)
def _hello(h: RankHandler, body: p.HelloRequest, ctx: Ctx) -> p.Body:
    return h.hello()


def _match_precheck(h: RankHandler, body: p.MatchRequest) -> None:
    if body.storage:
        _needs_storage(h)


# What a match without a storage lookup replies with (``tpcache.core.treecore.lookup``'s answer): its device
# pages, host pages and the device prefix's page ids (an ``array('i')``). A plain tuple: rank 0
# makes one per lookup, and a tuple costs a quarter of a NamedTuple.
Found = tuple[int, int, array]


def match_result(h: RankHandler, tokens: Any) -> p.MatchResult:
    """The reply to a match of ``tokens`` (ids, or their wire bytes) without a storage lookup."""
    return match_body(h.tp.lookup(tokens), h.tp.config.page_size)


def match_body(found: Found, page_size: int) -> p.MatchResult:
    """The reply body of a match that found ``found`` (``storage_pages`` 0)."""
    device, host, pages = found
    return p.MatchResult.unchecked((device + host) * page_size, device, host, 0, pages)  # type: ignore[return-value]


@handles(p.MatchRequest, precheck=_match_precheck)
def _match(h: RankHandler, body: p.MatchRequest, ctx: Ctx) -> p.Body | Watch:
    result = match_result(h, body.tokens)
    if not body.storage or h.tp.core.closed:
        return result
    # A storage lookup needs a lease to hang from: a transient one of the leader's, every rank alike.
    h.book.admit(LEADER)
    lease, _ = h.tp.lock(body.tokens)
    h.book.add(lease, LEADER)
    if not h.start_prefetch(lease, read=False):
        h.book.drop(lease)
        h.tp.release(lease)
        return result
    return Watch(
        lease,
        "wait_complete",
        0,
        lambda status, pages, ready, why: p.MatchResult.unchecked(
            result.hit_tokens, result.device_pages, result.host_pages, pages, result.device_page_ids
        ),
        transient=True,
        base=prefetch_base(h, lease),
    )


def prefetch_base(h: RankHandler, lease: int) -> int:
    """Where the lease's prefetch, just started, looks storage up from (its first missing page)."""
    progress = h.tp.core.prefetch_progress(lease)
    return 0 if progress is None else progress.start


def _lock_precheck(h: RankHandler, body: p.LockRequest) -> None:
    if body.prefetch not in (None, "none"):
        _needs_storage(h)


@handles(p.LockRequest, precheck=_lock_precheck)
def _lock(h: RankHandler, body: p.LockRequest, ctx: Ctx) -> p.Body | Watch:
    h.book.admit(ctx.conn)
    lease, m = h.tp.lock(body.tokens)
    h.book.add(lease, ctx.conn)
    hit = (m.device_pages + m.host_pages) * h.tp.config.page_size
    ids = m.device_page_array
    policy = body.prefetch or ("best_effort" if h.storage_prefetch else "none")
    if policy == "none" or h.tp.core.closed or not h.start_prefetch(lease):
        return p.LockResult.unchecked(lease, hit, m.device_pages, m.host_pages, 0, ids, None, None)
    page_size = h.tp.config.page_size
    return Watch(
        lease,
        policy,
        8 if body.timeout_rounds is None else body.timeout_rounds,
        # The storage pages already read to host are hits as the host's are: ``load`` serves them.
        lambda status, pages, ready, why: p.LockResult.unchecked(
            lease, hit + ready * page_size, m.device_pages, m.host_pages, pages, ids, ready, why
        ),
        base=prefetch_base(h, lease),
    )


@handles(p.PrefetchRequest, precheck=lambda h, body: _needs_storage(h))
def _prefetch(h: RankHandler, body: p.PrefetchRequest, ctx: Ctx) -> p.Body | Watch:
    h.leased(body.lease, ctx)
    if h.tp.core.closed:
        raise p.CacheClosed(f"the cache is closed ({h.tp.core.closed_reason}): nothing is read from storage")
    h.start_prefetch(body.lease)
    return Watch(
        body.lease,
        body.policy,
        body.timeout_rounds,
        lambda status, pages, ready, why: p.PrefetchResult(status, pages, ready, why),
        base=prefetch_base(h, body.lease),
    )


@handles(p.AllocRequest)
def _alloc(h: RankHandler, body: p.AllocRequest, ctx: Ctx) -> p.Body:
    h.leased(body.lease, ctx)
    return p.AllocResult(h.tp.alloc(body.lease, body.num_pages))


def _insert_precheck(h: RankHandler, body: p.InsertRequest) -> None:
    if body.lease is None:
        raise p.InvalidArgument("insert needs a lease (lock, then alloc pages under it)")


@handles(p.InsertRequest, precheck=_insert_precheck)
def _insert(h: RankHandler, body: p.InsertRequest, ctx: Ctx) -> p.Body:
    assert body.lease is not None  # precheck
    h.leased(body.lease, ctx)
    inserted, dup = h.tp.insert(body.lease, body.tokens, body.device_page_ids)
    return p.InsertResult(inserted, dup)


@handles(p.AppendRequest)
def _append(h: RankHandler, body: p.AppendRequest, ctx: Ctx) -> p.Body:
    h.leased(body.lease, ctx)
    inserted, dup = h.tp.append(body.lease, body.tokens, body.device_page_ids)
    return p.AppendResult(inserted, dup)


@handles(p.LoadRequest)
def _load(h: RankHandler, body: p.LoadRequest, ctx: Ctx) -> p.Body | Watch:
    """The reply waits (a Watch) until every rank agreed the copies landed: then each page it
    lists is device-valid, readable by ``get_pages``, and its storage hits are counted."""
    h.leased(body.lease, ctx)
    pages = list(h.tp.load(body.lease).device_pages)
    return Watch(body.lease, "load", 0, p.LoadResult, load=pages)


@handles(p.ReleaseRequest)
def _release(h: RankHandler, body: p.ReleaseRequest, ctx: Ctx) -> p.Body:
    h.leased(body.lease, ctx)
    h.book.drop(body.lease)
    h.tp.release(body.lease)
    return p.ReleaseResult()


@handles(p.AbortRequest)
def _abort(h: RankHandler, body: p.AbortRequest, ctx: Ctx) -> p.Body:
    h.leased(body.lease, ctx)
    h.book.drop(body.lease)
    h.tp.release(body.lease)  # pages allocated and not inserted go back with the lease
    return p.AbortResult()


@handles(p.StepRequest)
def _step(h: RankHandler, body: p.StepRequest, ctx: Ctx) -> Deferred:
    return Deferred(lambda report: p.StepResult(report.round))


@handles(p.FlushRequest)
def _flush(h: RankHandler, body: p.FlushRequest, ctx: Ctx) -> Deferred:
    h.tp.request_flush()
    return Deferred(lambda report: p.FlushResult(report.round))


def _set_config_precheck(h: RankHandler, body: p.SetConfigRequest) -> None:
    if body.storage_prefetch:
        _needs_storage(h)


@handles(p.SetConfigRequest, precheck=_set_config_precheck)
def _set_config(h: RankHandler, body: p.SetConfigRequest, ctx: Ctx) -> p.Body:
    """Every rank changes its settings at the same point of the sequence: agreed by construction."""
    if body.retention_cap_tokens is not None:
        h.tp.set_retention_cap(body.retention_cap_tokens)
    if body.mirror_release is not None:
        h.tp.set_mirror_release(body.mirror_release)
    if body.storage_prefetch is not None:
        h.storage_prefetch = body.storage_prefetch
    return p.SetConfigResult(h.settings())


@handles(p.HealthRequest)
def _health(h: RankHandler, body: p.HealthRequest, ctx: Ctx) -> p.Body:
    health = h.tp.health()
    return p.HealthResult(health["state"], health["reason"], health["round"])


RANK_KEYS = ("digest", "rounds", "seq", "closed", "leases", "device_pages_used", "host_pages_used")
RANK_KEYS += ("internal_rejected_frames", "storage_written_pages")  # stats shows these per rank: rank<r>.<key>


def _merge_stats(outcome: p.StatsResult, answers: dict[int, dict[str, Any]]) -> p.Body:
    values = dict(outcome.values)
    per_rank = {0: values, **{r: a.get("values", {}) for r, a in answers.items()}}
    for r in sorted(per_rank):
        for key in RANK_KEYS:
            values[f"rank{r}.{key}"] = per_rank[r].get(key)
    digests = {per_rank[r].get("digest") for r in per_rank}
    values["digests_equal"] = len(digests) == 1 and None not in digests
    return p.StatsResult(values)


@handles(
    p.StatsRequest,
    payload=lambda outcome: {"values": dict(outcome.values)},
    merge=_merge_stats,
)
def _stats(h: RankHandler, body: p.StatsRequest, ctx: Ctx) -> Deferred:
    return Deferred(lambda report: p.StatsResult(h.stats_values()))


def _register_precheck(h: RankHandler, body: p.RegisterBuffersRequest) -> None:
    ranks = [d.get("rank") for d in body.descriptors]
    if sorted(r for r in ranks if type(r) is int) != list(range(h.tp.world_size)):
        raise p.InvalidArgument(f"register_buffers needs exactly one descriptor per rank 0..{h.tp.world_size - 1}")


@handles(
    p.RegisterBuffersRequest,
    precheck=_register_precheck,
    payload=lambda outcome: {},
    merge=lambda outcome, answers: outcome,
)
def _register_buffers(h: RankHandler, body: p.RegisterBuffersRequest, ctx: Ctx) -> p.Body:
    """First phase: map this rank's buffer; the leader commits every rank's in a later batch."""
    mine = [d for d in body.descriptors if d.get("rank") == h.rank]
    if len(mine) != 1:
        raise p.InvalidArgument(f"expected one descriptor for rank {h.rank}, got {len(mine)}")
    if h.tp.kv_layout is None:
        raise p.InvalidArgument("registering buffers needs a KV layout: start the service with --kv-layout")
    try:
        h.staged[ctx.token] = stage_buffer(mine[0], h.tp.kv_layout, h.tp.config.device_pages)
    except KVBufferError as exc:
        raise p.InvalidArgument(f"rank {h.rank}: {exc}") from None
    return p.RegisterBuffersResult(len(body.descriptors))


def _put_pages_precheck(h: RankHandler, body: p.PutPagesRequest) -> None:
    _needs_pages(h)
    if body.lease is None:
        raise p.InvalidArgument("put_pages writes only pages a lease allocated: give that lease")


@handles(
    p.PutPagesRequest,
    precheck=_put_pages_precheck,
    payload=lambda outcome: {},
    merge=lambda outcome, answers: outcome,
)
def _put_pages(h: RankHandler, body: p.PutPagesRequest, ctx: Ctx) -> p.Body:
    """``data`` holds every rank's share, rank-major; each share is its pages in order. Only pages
    the lease allocated and has not inserted: cached bytes never change through the protocol."""
    assert body.lease is not None  # precheck
    pages = h.pages(body.page_ids)
    owned = set(h.lease_pages(body.lease, ctx))
    foreign = [page for page in pages if page not in owned]
    if foreign:
        raise p.InvalidArgument(f"put_pages: page {foreign[0]} is not a page lease {body.lease} allocated and holds")
    pool = h.tp.device_pool
    assert pool is not None
    size = pool.layout.page_bytes
    world = h.tp.world_size
    if len(body.data) != size * len(pages) * world:
        raise p.InvalidArgument(
            f"put_pages: {len(body.data)} bytes; {world} rank shares of {len(pages)} pages of {size} bytes "
            f"need {size * len(pages) * world}"
        )
    share = size * len(pages)
    view = memoryview(body.data)[h.rank * share : (h.rank + 1) * share]
    for i, page in enumerate(pages):
        pool.write_page(page, view[i * size : (i + 1) * size])
    return p.PutPagesResult(len(pages))


def _join_pages(outcome: p.GetPagesResult, answers: dict[int, dict[str, Any]]) -> p.Body:
    return p.GetPagesResult(b"".join([outcome.data] + [answers[r].get("data", b"") for r in sorted(answers)]))


def _get_pages_bytes(h: RankHandler, body: p.GetPagesRequest) -> int:
    pool = h.tp.device_pool
    return 0 if pool is None else len(body.page_ids) * pool.layout.page_bytes * h.tp.world_size


@handles(
    p.GetPagesRequest,
    precheck=lambda h, body: _needs_pages(h),
    reply_bytes=_get_pages_bytes,
    payload=lambda outcome: {"data": outcome.data},
    merge=_join_pages,
)
def _get_pages(h: RankHandler, body: p.GetPagesRequest, ctx: Ctx) -> p.Body:
    """This rank's share; the leader joins every rank's, rank-major (as put_pages takes them).
    Only pages cached and agreed (VALID) while the cache is open, or held by the caller's lease."""
    pages = h.pages(body.page_ids)
    owned = set(h.lease_pages(body.lease, ctx)) if body.lease is not None else set()
    if any(page not in owned for page in pages):
        if h.tp.core.closed:
            raise p.CacheClosed(f"the cache is closed ({h.tp.core.closed_reason}): cached pages are not served")
        valid = h.valid_pages()
        unreadable = [page for page in pages if page not in owned and page not in valid]
        if unreadable:
            raise p.InvalidArgument(
                f"get_pages: page {unreadable[0]} is neither cached (and agreed) nor held by the caller's lease"
            )
    pool = h.tp.device_pool
    assert pool is not None
    size = pool.layout.page_bytes * len(pages) * h.tp.world_size
    if size > p.DEFAULT_LIMITS.max_inline_bytes:
        raise p.MessageTooLarge(f"get_pages: {size} bytes, more than {p.DEFAULT_LIMITS.max_inline_bytes}")
    return p.GetPagesResult(b"".join(pool.read_page(page).numpy().tobytes() for page in pages))


def gathered_payload(body: p.Body, outcome: Any) -> dict[str, Any]:
    """What a follower sends the leader for a gathered request (its error, or the op's payload)."""
    failed = error_payload(outcome)
    if failed is not None:
        return failed
    payload = OPS[body.OP].payload
    return payload(outcome) if payload is not None else {}


def merge_gathered(body: p.Body, outcome: Any, answers: dict[int, dict[str, Any]]) -> Any:
    """The reply to a gathered request from the leader's outcome and every follower's answer."""
    if isinstance(outcome, p.ProtocolError):
        return outcome
    failed = first_failure(answers)
    if failed is not None:
        return failed
    merge = OPS[body.OP].merge
    return merge(outcome, answers) if merge is not None else outcome
