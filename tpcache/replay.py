"""Replay a request stream through one CacheCore, as a single rank with a synchronous shell.

For each request in order: lock (match + pin), load host hits back, allocate device pages for the
rest, insert its full pages, release. In-flight copies complete at once (one rank agrees with
itself), so the result is the cache's decisions alone, comparable with any simulator of the same
semantics.

With components (a hybrid model), a request is prefilled in chunks as an engine does: each chunk
asks ``chunk_tokens`` how much the pools take now (shrinking instead of refusing), allocates full
pages, SWA pages and states for it, and inserts; the insert frees the request's SWA behind its
window. The result then also reports the pages each component holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from tpcache.core import CacheConfig, CacheCore, OpKind, OutOfPages
from tpcache.core.hashing import as_token_bytes
from tpcache.core.hitrule import keeps_state
from tpcache.workload.trace import Request, request_tokens


@dataclass
class ReplayResult:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    pages: int = 0
    refused_pages: int = 0  # pages not cached because every device page was pinned
    seconds: float = 0.0  # the cache's time: the requests' token ids are made outside it
    cpu_seconds: float = 0.0  # the same in this thread's CPU time: steadier than ``seconds`` on a shared machine
    digest: int = 0
    held: dict[str, int] | None = None  # hybrid: device pages (slots) each component holds at the end
    mean_held: dict[str, float] | None = None  # hybrid: the same, averaged over the requests

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.seconds if self.seconds else 0.0

    @property
    def pages_per_cpu_s(self) -> float:
        return self.pages / self.cpu_seconds if self.cpu_seconds else 0.0

    def to_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = asdict(self)
        if self.held is None:
            del d["held"], d["mean_held"]
        d["hit_rate"] = round(self.hit_rate, 6)
        d["pages_per_s"] = round(self.pages_per_s, 1)
        d["seconds"] = round(self.seconds, 3)
        d["pages_per_cpu_s"] = round(self.pages_per_cpu_s, 1)
        d["cpu_seconds"] = round(self.cpu_seconds, 3)
        return d


_KINDS = tuple(OpKind)  # iterating the enum itself costs a generator per call


def drain(core: CacheCore) -> None:
    """Complete every in-flight copy (a one-rank round agrees with itself), acting on the Ready.
    With components, also what a commit does after its completions (freeing the SWA behind
    windows that was waiting for its backups, retrying component backlogs)."""
    inflight = core.inflight
    if any(inflight.values()):  # most requests start no copy: one look at every queue
        for kind in _KINDS:
            while inflight[kind]:
                core.complete(kind)
    if core.hybrid is not None:
        core.after_commit()
    if core.retention_cap_tokens >= 0:  # (a negative cap, no cap: nothing to enforce)
        core.enforce_retention()
    if core.has_ready():
        core.ready()
        core.advance()


def replay_request(core: CacheCore, tokens, result: ReplayResult) -> None:  # noqa: ANN001
    page_size = core.page_size
    # Converted to the cache's int32 key bytes once, as an engine that calls lock and insert with the
    # same ids would (inside the clock: the conversion is the cache's work, not the workload's).
    data = as_token_bytes(tokens)
    lease, match = core.lock(data)
    full = match.num_pages
    device_ids = match.device_page_ids  # a new list
    if match.host_pages:
        with contextlib.suppress(OutOfPages):  # no room to load the host hits now: computed again instead
            device_ids = core.load(lease)
        drain(core)
    hit = match.device_pages + match.host_pages
    result.requests += 1
    result.input_tokens += len(data) // 4  # int32 bytes
    result.hit_tokens += hit * page_size
    result.device_hit_tokens += match.device_pages * page_size
    result.host_hit_tokens += match.host_pages * page_size
    result.pages += full
    missing = full - len(device_ids)
    try:
        fresh = core.alloc(lease, missing) if missing > 0 else []  # as the service replay does
        core.insert(lease, data, device_ids + fresh)
    except OutOfPages:
        result.refused_pages += missing
    core.release(lease)
    drain(core)


def replay_hybrid_request(core: CacheCore, tokens, result: ReplayResult, chunk: int) -> None:  # noqa: ANN001
    """One request of a hybrid model, prefilled in chunks of at most ``chunk`` tokens."""
    ps = core.page_size
    data = as_token_bytes(tokens)  # once, as in replay_request
    lease, match = core.lock(data)
    full = match.num_pages
    pages = list(match.device_page_ids)
    if match.host_pages:
        with contextlib.suppress(OutOfPages):
            pages = core.load(lease)
        drain(core)
    result.requests += 1
    result.input_tokens += len(data) // 4  # int32 bytes
    result.hit_tokens += (match.device_pages + match.host_pages) * ps
    result.device_hit_tokens += match.device_pages * ps
    result.host_hit_tokens += match.host_pages * ps
    result.pages += full
    done = len(pages)
    try:
        while done < full:
            take = core.chunk_tokens(lease, done * ps, min(chunk, (full - done) * ps)) // ps
            if not take:
                raise OutOfPages("no room for a chunk")
            pages += core.alloc(lease, take)
            parts = {}
            for c, part in core.ledger.parts.items():
                every = part.spec.every
                at = [i for i in range(done, done + take) if not every or keeps_state(every, i, done + take - 1)]
                row = [-1] * (done + take)
                for i, slot in zip(at, core.alloc(lease, len(at), c), strict=True):
                    row[i] = slot
                parts[c] = row
            core.insert(lease, data[: (done + take) * ps * 4], pages, parts)  # int32 bytes
            done += take
            drain(core)  # the chunk's forward pass and copies finish before the next chunk
    except OutOfPages:
        result.refused_pages += full - done
    core.release(lease)
    drain(core)


def replay(
    requests: Iterable[Request],
    config: CacheConfig,
    progress: Callable[[int], None] | None = None,
    chunk_tokens: int = 8192,
) -> tuple[ReplayResult, CacheCore]:
    """Replay ``requests``; a hybrid configuration prefills in chunks of ``chunk_tokens``."""
    core = CacheCore(config)
    result = ReplayResult()
    specs = config.components()
    totals = dict.fromkeys(["full", *(s.name for s in specs)], 0)
    # The clocks count the cache's work only: making each request's token ids from the trace's block
    # hashes is the workload's (an engine has them from its tokenizer).
    for req in requests:
        tokens = request_tokens(req)
        start, cpu_start = time.perf_counter(), time.thread_time()
        if specs:
            replay_hybrid_request(core, tokens, result, chunk_tokens)
        else:
            replay_request(core, tokens, result)
        result.seconds += time.perf_counter() - start
        result.cpu_seconds += time.thread_time() - cpu_start
        if specs:
            for name, used in _held(core).items():
                totals[name] += used
        if progress is not None:
            progress(1)
    result.digest = core.digest.value
    if specs:
        result.held = _held(core)
        result.mean_held = {k: round(v / max(1, result.requests), 1) for k, v in totals.items()}
    return result, core


def _held(core: CacheCore) -> dict[str, int]:
    out = {"full": core.device.used}
    out.update((p.name, p.device.used) for p in core.ledger.parts.values())
    return out


def config_for_tokens(device_tokens: int | None, page_size: int, **kw: object) -> CacheConfig:
    """A config whose device pool holds ``device_tokens`` (None: effectively unbounded)."""
    pages = (1 << 40) // page_size if device_tokens is None else device_tokens // page_size
    return CacheConfig(page_size=page_size, device_pages=min(pages, 1 << 26), **kw)  # type: ignore[arg-type]
