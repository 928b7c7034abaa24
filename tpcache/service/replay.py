"""Replay a request stream through a running service, doing per request what the single-rank
``tpcache.replay.replay`` does: lock, load host hits, allocate the missing pages, insert, release.

Each call waits for its reply, and the service answers only after the round that covers the
request committed; in metadata mode that round also completes every copy the request issued.
So by the time the next call is applied, the service is where the single-rank replay is after
its ``drain``: same decisions, same hit tokens (``tests/service/test_equivalence.py``).

``replay_pipelined`` keeps many requests in flight instead, the way an engine's scheduler step
does: it takes the next ``in_flight`` requests as one wave and sends each stage of the wave as a
burst (every lock, then every load, alloc, insert and release), waiting for a stage's replies
before the next stage. The service batches a burst into few rounds, so its requests/s measure the
service rather than one round trip per call. The calls of a wave reach the service in a fixed
order, but requests of one wave do not see each other's inserts (they run side by side), and a
wave pins all its prefixes at once, so hit rates and refused pages can differ from the
call-at-a-time replay.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

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


def replay_pipelined(
    client: Client,
    requests: Iterable[Request],
    in_flight: int,
    progress: Callable[[int], None] | None = None,
    *,
    result: ReplayResult | None = None,
) -> tuple[ReplayResult, int]:
    """Replay ``requests`` in waves of ``in_flight`` (module docstring); returns what
    ``replay_through_service`` returns."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    assert client.info is not None, "the client must have said hello"
    page_size = client.info.page_size
    result = ReplayResult() if result is None else result
    calls = 0
    start = time.perf_counter()
    wave: list[Any] = []
    for req in requests:
        wave.append(request_tokens(req))
        if len(wave) == in_flight:
            calls += _replay_wave(client, wave, page_size, result)
            if progress is not None:
                progress(len(wave))
            wave = []
    if wave:
        calls += _replay_wave(client, wave, page_size, result)
        if progress is not None:
            progress(len(wave))
    result.seconds = time.perf_counter() - start
    return result, calls


def _burst(client: Client, bodies: list[p.Body], no_space: bool = False) -> list[Any]:
    """Send ``bodies`` back to back, then wait for each reply: its result, or (with ``no_space``)
    the NoSpace error it got. Any other error is raised, after every reply of the burst came."""
    ids = client.submit_many(bodies)
    out: list[Any] = []
    error: p.ProtocolError | None = None
    for request_id in ids:
        try:
            out.append(client.wait(request_id))
        except p.NoSpace as exc:
            if not no_space and error is None:
                error = exc
            out.append(exc)
        except p.ProtocolError as exc:
            error = error or exc
            out.append(exc)
    if error is not None:
        raise error
    return out


def _replay_wave(client: Client, wave: list[Any], page_size: int, result: ReplayResult) -> int:
    """One wave, stage by stage, doing per request what ``replay_request`` does; returns the calls."""
    locks = _burst(client, [p.LockRequest(tokens=tokens) for tokens in wave])
    calls = len(locks)
    device_ids = [list(lk.device_page_ids) for lk in locks]
    loading = [i for i, lk in enumerate(locks) if lk.host_pages]
    loads = _burst(client, [p.LoadRequest(lease=locks[i].lease) for i in loading], no_space=True)
    calls += len(loads)
    for i, loaded in zip(loading, loads, strict=True):
        if not isinstance(loaded, p.NoSpace):  # no room to load the host hits now: computed again instead
            device_ids[i] = list(loaded.device_page_ids)
    missing = []
    for tokens, lk, ids in zip(wave, locks, device_ids, strict=True):
        result.requests += 1
        result.input_tokens += len(tokens)
        result.hit_tokens += lk.hit_tokens
        result.device_hit_tokens += lk.device_pages * page_size
        result.host_hit_tokens += lk.host_pages * page_size
        full = len(tokens) // page_size
        result.pages += full
        missing.append(full - len(ids))
    allocating = [i for i, m in enumerate(missing) if m > 0]
    allocs = _burst(
        client, [p.AllocRequest(lease=locks[i].lease, num_pages=missing[i]) for i in allocating], no_space=True
    )
    calls += len(allocs)
    refused: set[int] = set()
    for i, fresh in zip(allocating, allocs, strict=True):
        if isinstance(fresh, p.NoSpace):
            refused.add(i)
        else:
            device_ids[i] += list(fresh.device_page_ids)
    inserting = [i for i in range(len(wave)) if i not in refused]
    inserts = _burst(
        client,
        [p.InsertRequest(tokens=wave[i], device_page_ids=device_ids[i], lease=locks[i].lease) for i in inserting],
        no_space=True,
    )
    calls += len(inserts)
    refused.update(i for i, done in zip(inserting, inserts, strict=True) if isinstance(done, p.NoSpace))
    result.refused_pages += sum(missing[i] for i in refused)
    releases = _burst(client, [p.ReleaseRequest(lease=lk.lease) for lk in locks])
    return calls + len(releases)


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
