"""Replay a request stream through a running service, doing per request what the single-rank
``tpcache.replay.replay`` does: lock, load host hits, allocate the missing pages, insert, release.

Each call waits for its reply, and the service answers only after the round that covers the
request committed; in metadata mode that round also completes every copy the request issued.
So by the time the next call is applied, the service is where the single-rank replay is after
its ``drain``: same decisions, same hit tokens (``tests/service/test_equivalence.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import protocol as p
from tpcache.client import Client
from tpcache.replay import ReplayResult
from tpcache.workload.trace import Request, request_tokens


def replay_request(client: Client, tokens: object, page_size: int, result: ReplayResult) -> int:
    """One request; returns the number of calls it made."""
    lk = client.lock(tokens)
    calls = 1
    full = len(tokens) // page_size  # type: ignore[arg-type]
    device_ids = list(lk.device_page_ids)
    if lk.host_pages:
        calls += 1
        with contextlib.suppress(p.NoSpace):  # no room to load the host hits now: computed again instead
            device_ids = list(client.load(lk.lease).device_page_ids)
    result.requests += 1
    result.input_tokens += len(tokens)  # type: ignore[arg-type]
    result.hit_tokens += lk.hit_tokens
    result.device_hit_tokens += lk.device_pages * page_size
    result.host_hit_tokens += lk.host_pages * page_size
    result.pages += full
    missing = full - len(device_ids)
    try:
        fresh = list(client.alloc(lk.lease, missing).device_page_ids) if missing > 0 else []
        calls += missing > 0
        client.insert(tokens, device_ids + fresh, lease=lk.lease)  # type: ignore[arg-type]
        calls += 1
    except p.NoSpace:
        result.refused_pages += missing
    client.release(lk.lease)
    return calls + 1


def replay_through_service(
    client: Client,
    requests: Iterable[Request],
    progress: Callable[[int], None] | None = None,
    *,
    result: ReplayResult | None = None,
) -> tuple[ReplayResult, int]:
    """Replay ``requests``; returns the result (``result`` if given, updated as it goes, so a
    caller can watch it or see how far an interrupted replay got) and the number of calls made."""
    assert client.info is not None, "the client must have said hello"
    page_size = client.info.page_size
    result = ReplayResult() if result is None else result
    calls = 0
    start = time.perf_counter()
    for req in requests:
        calls += replay_request(client, request_tokens(req), page_size, result)
        if progress is not None:
            progress(1)
    result.seconds = time.perf_counter() - start
    return result, calls
