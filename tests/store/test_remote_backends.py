"""The backend contract on real stores (Mooncake Store, redis-server): per-key results, verified
reads, values that are not this key's page are counted misses, never served."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.storage.storage_helpers import make_keys, make_page
from tests.store.conftest import BACKENDS, store_url
from tpcache.io.storage import StorageBackend, StorageClosedError, StorageKey, StorageKeyError, open_storage
from tpcache.io.storage.buffers import StorageBufferError, byte_view
from tpcache.io.storage.record import HEADER_SIZE, encode_header, payload_checksum
from tpcache.testing.procs import stopped
from tpcache.testing.servers import MooncakeStore, RedisServer

pytestmark = pytest.mark.xdist_group("store")
PAGE = 4096


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[StorageBackend]:
    b = open_storage(store_url(request, request.param) + _prefix(request), shard=(0, 1))
    yield b
    b.close()


def _prefix(request: pytest.FixtureRequest) -> str:
    sep = "&" if request.param == "mooncake" else "?"
    return f"{sep}prefix={request.node.name.replace('[', '-').rstrip(']')}/"


def _raw_put(b: StorageBackend, key: StorageKey, value: bytes) -> None:
    """Write ``value`` under ``key``'s store name with the store's own client, behind tpcache."""
    name = b._prefix + key.encode()  # type: ignore[attr-defined]
    if hasattr(b, "_client"):
        b._client.set(name, value)  # type: ignore[attr-defined]
    else:
        assert b._store.upsert(name, value) == 0  # type: ignore[attr-defined]


def _record(key: StorageKey, payload: bytes) -> bytes:
    echo = key.encode().encode()
    return encode_header(echo, 0, len(payload), payload_checksum(payload)) + payload


def test_round_trip_and_per_key_results(backend: StorageBackend) -> None:
    keys = make_keys(6)
    pages = [make_page(i, PAGE) for i in range(6)]
    assert backend.put(keys[::2], pages[::2]) == [True] * 3
    assert backend.exists(keys) == [True, False] * 3
    out = [bytearray(PAGE) for _ in keys]
    assert backend.get(keys, out) == [True, False] * 3
    assert [bytes(o) for o in out[::2]] == pages[::2]
    assert out[1] == bytearray(PAGE)
    s = backend.stats()
    assert (s["puts"], s["put_ok"], s["hits"], s["misses_missing"]) == (3, 3, 3, 3)
    assert backend.delete(keys[:2]) == [True, False]
    assert backend.exists(keys[:3]) == [False, False, True]


def test_tensors_in_and_out_without_copies_of_the_caller(backend: StorageBackend) -> None:
    keys = make_keys(3)
    pages = [torch.arange(1024, dtype=torch.float32) * (i + 1) for i in range(3)]
    assert backend.put(keys, pages) == [True] * 3
    out = torch.zeros(3, 1024, dtype=torch.float32)
    assert backend.get(keys, [out[0], out[1], out[2]]) == [True] * 3
    assert all(torch.equal(out[i], pages[i]) for i in range(3))


def test_a_put_replaces_an_older_value(backend: StorageBackend) -> None:
    """The store's own put keeps the first writer's bytes; tpcache's put replaces them."""
    key = make_keys(1)[0]
    _raw_put(backend, key, _record(key, make_page(1, PAGE)))
    assert backend.put([key], [make_page(2, PAGE)]) == [True]
    out = [bytearray(PAGE)]
    assert backend.get([key], out) == [True]
    assert bytes(out[0]) == make_page(2, PAGE)


@pytest.mark.parametrize(
    "case",
    ["other_rank", "other_layout", "other_page_size", "flipped_payload", "flipped_header", "truncated", "not_ours"],
)
def test_a_value_that_is_not_this_keys_page_is_a_counted_miss(backend: StorageBackend, case: str) -> None:
    key = make_keys(1)[0]
    page = make_page(7, PAGE)
    value = bytearray(_record(key, page))
    reason = "foreign"
    if case == "other_rank":
        value = bytearray(_record(StorageKey("ns", 1, 1, 2, key.page_hash), page))
    elif case == "other_layout":
        value = bytearray(_record(StorageKey("ns", 2, 0, 1, key.page_hash), page))
    elif case == "other_page_size":
        value = bytearray(_record(key, page[: PAGE // 2]))
    elif case == "flipped_payload":
        value[-5] ^= 0x40
        reason = "corrupt"
    elif case == "flipped_header":
        value[20] ^= 0x01
        reason = "corrupt"
    elif case == "truncated":
        value = value[: HEADER_SIZE + 40 + PAGE // 2]
        reason = "short"
    else:
        value = bytearray(b"someone else's value")
        reason = "short"
    _raw_put(backend, key, bytes(value))
    assert backend.exists([key]) == [True]  # only a hint
    out = [bytearray(b"\xee" * PAGE)]
    assert backend.get([key], out) == [False]
    assert out[0] in (bytearray(PAGE), bytearray(b"\xee" * PAGE))  # never the stored bytes
    s = backend.stats()
    misses = 1
    if "gets_direct" in s and len(value) != len(_record(key, page)):
        # Mooncake refuses a read into the caller's page whose buffers do not add up to the value's
        # size with the code a failed transfer has: an I/O error, and a renewed client.
        assert (s["misses_io_error"], s["client_renewals"]) == (1, 1)
        backend._placed_min = None  # type: ignore[attr-defined]  # the staging path tells why
        assert backend.get([key], out) == [False]
        s, misses = backend.stats(), 2
    assert (s["hits"], s["misses"], s[f"misses_{reason}"]) == (0, misses, 1)


def test_caller_bugs_are_typed_errors_before_any_io(backend: StorageBackend) -> None:
    keys = make_keys(2)
    with pytest.raises(ValueError):
        backend.put(keys, [make_page(0, PAGE)])
    with pytest.raises(StorageBufferError):
        backend.get(keys[:1], [b"read-only"])
    with pytest.raises(StorageKeyError):
        backend.exists(["v1/n_ns/0/0of1/0000000000000001"])  # type: ignore[list-item]
    assert backend.stats()["puts"] == 0


def test_keys_of_another_shard_are_refused(request: pytest.FixtureRequest) -> None:
    with open_storage(store_url(request, "redis"), shard=(0, 2)) as b, pytest.raises(StorageKeyError):
        b.put([StorageKey("ns", 1, 1, 2, 5)], [make_page(0, PAGE)])


def test_closed_backend_refuses(backend: StorageBackend) -> None:
    backend.close()
    with pytest.raises(StorageClosedError):
        backend.get(make_keys(1), [bytearray(PAGE)])


def test_a_stopped_server_fails_calls_cleanly_then_recovers(tmp_path) -> None:
    with RedisServer(tmp_path) as server:
        b = open_storage(server.url + "?timeout=2&retry_s=0.2", shard=(0, 1))
        keys = make_keys(2)
        assert b.put(keys, [make_page(0, PAGE), make_page(1, PAGE)]) == [True, True]
        server.stop()
        assert b.put(keys, [make_page(0, PAGE)] * 2) == [False, False]
        assert b.get(keys, [bytearray(PAGE), bytearray(PAGE)]) == [False, False]  # fails fast meanwhile
        assert b.exists(keys) == [False, False]
        s = b.stats()
        assert s["put_failures_io_error"] == 2 and s["misses_io_error"] == 2 and s["unavailable"] >= 2
        server.start()  # empty: no persistence
        deadline = 100
        while not b.put(keys[:1], [make_page(5, PAGE)])[0] and deadline:
            deadline -= 1
            __import__("time").sleep(0.05)
        out = [bytearray(PAGE), bytearray(PAGE)]
        assert b.get(keys, out) == [True, False]
        assert bytes(out[0]) == make_page(5, PAGE)
        b.close()


def test_a_full_server_is_no_space(tmp_path) -> None:
    with RedisServer(tmp_path) as server:
        b = open_storage(server.url, shard=(0, 1))
        b._client.config_set("maxmemory", "4mb")  # type: ignore[attr-defined]
        b._client.config_set("maxmemory-policy", "noeviction")  # type: ignore[attr-defined]
        results = b.put(make_keys(16), [make_page(i, 1 << 20) for i in range(16)])
        assert results[0] and not results[-1]
        assert b.stats()["put_failures_no_space"] == results.count(False)
        b.close()


def _mooncake(
    request: pytest.FixtureRequest, direct_put: str, direct_get: str = "0", url: str = "", deadline: str = "0"
) -> StorageBackend:
    """A Mooncake backend; without a deadline by default (reads into the caller's pages need none)."""
    url = url or request.getfixturevalue("mooncake_store").url
    settings = f"&direct_put={direct_put}&direct_get={direct_get}&deadline={deadline}&prefix={request.node.name}/"
    return open_storage(url + settings, shard=(0, 1))


def test_mooncake_puts_large_writable_pages_from_the_callers_memory(request: pytest.FixtureRequest) -> None:
    """At or above ``direct_put`` a writable page is put from where the caller keeps it; a smaller
    or read-only page, or a key the store has already (a put would keep the old value), goes
    through the staging buffer. Each reads back as written, in one call."""
    big, small = 4 * PAGE, PAGE
    with _mooncake(request, f"{big}") as b:
        keys = make_keys(5)
        old = make_keys(1, base=100)[0]
        _raw_put(b, old, _record(old, make_page(1, big)))
        pages = [
            bytearray(make_page(0, big)),  # direct
            torch.full((big // 4,), 3.0),  # direct: a host-pool-like tensor
            make_page(2, big),  # read-only bytes: staged
            bytearray(make_page(3, small)),  # small: staged
            bytearray(make_page(4, big)),  # its key is in the store already: staged upsert
        ]
        assert b.put([*keys[:4], old], pages) == [True] * 5
        assert b.stats()["puts_direct"] == 2
        out = [bytearray(big), torch.zeros(big // 4), bytearray(big), bytearray(small), bytearray(big)]
        assert b.get([*keys[:4], old], out) == [True] * 5
        assert bytes(out[0]) == bytes(pages[0]) and torch.equal(out[1], pages[1])
        assert [bytes(o) for o in out[2:]] == [pages[2], bytes(pages[3]), bytes(pages[4])]


class _ChangesPagesInFlight:
    """The Mooncake client, except that a direct put's page changes after tpcache checksummed it
    and before the store reads it (a caller that broke its promise to hold the page still)."""

    def __init__(self, store: Any, page: bytearray) -> None:
        self._store, self._page = store, page

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_put_from_multi_buffers(self, *args: Any) -> Any:
        self._page[100] ^= 0xFF
        return self._store.batch_put_from_multi_buffers(*args)


def test_a_page_that_changes_during_a_direct_put_is_never_served(request: pytest.FixtureRequest) -> None:
    with _mooncake(request, "0") as b:
        key = make_keys(1)[0]
        page = bytearray(make_page(9, PAGE))
        b._store = _ChangesPagesInFlight(b._store, page)  # type: ignore[attr-defined]
        try:
            assert b.put([key], [page]) == [True]  # the store holds a value; tpcache cannot tell it changed
        finally:
            b._store = b._store._store  # type: ignore[attr-defined]
        out = [bytearray(PAGE)]
        assert b.get([key], out) == [False]
        assert out[0] == bytearray(PAGE)
        s = b.stats()
        assert (s["puts_direct"], s["hits"], s["misses_corrupt"]) == (1, 0, 1)


def test_mooncake_reads_large_pages_into_the_callers_memory(request: pytest.FixtureRequest) -> None:
    """At or above ``direct_get`` a page is read where the caller keeps it and checked there: a
    damaged value is a corrupt miss with the page zero-filled (and no reason to renew the client)."""
    big, small = 4 * PAGE, PAGE
    with _mooncake(request, "0", direct_get=f"{big}") as b:
        keys = make_keys(4)
        pages = [make_page(i, big) for i in range(2)] + [make_page(2, small), make_page(3, big)]
        assert b.put(keys, pages) == [True] * 4
        damaged = bytearray(_record(keys[3], pages[3]))
        damaged[-5] ^= 0x40
        _raw_put(b, keys[3], bytes(damaged))
        out = [bytearray(big), torch.zeros(big // 4), bytearray(small), bytearray(b"\xee" * big)]
        assert b.get(keys, out) == [True, True, True, False]
        assert [bytes(out[0]), bytes(byte_view(out[1])), bytes(out[2])] == pages[:3]
        assert out[3] == bytearray(big)
        s = b.stats()
        assert (s["gets_direct"], s["hits"], s["misses_corrupt"], s["client_renewals"]) == (3, 3, 1, 0)


@pytest.fixture(scope="module")
def own_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    """A Mooncake Store of this module's own, for tests that stop or kill its segment holder."""
    try:
        store = MooncakeStore(tmp_path_factory.mktemp("own-mooncake"), holder_bytes=64 << 20)
        store.start()
    except Exception as exc:  # noqa: BLE001 - the reason is the test's failure
        pytest.fail(f"cannot start a Mooncake Store: {exc}", pytrace=False)
    yield store
    store.stop()


class _Watched:
    """The Mooncake client, noting when it is closed."""

    def __init__(self, store: Any, log: list[str]) -> None:
        self._store, self._log = store, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> int:
        self._log.append("closed")
        return self._store.close()


def test_a_stalled_segment_holder_fails_direct_reads_after_the_client_is_renewed(
    request: pytest.FixtureRequest, own_store: MooncakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read into the caller's pages from a SIGSTOPped holder fails; before ``get`` answers, the
    old client is closed (its transfers can no longer write) and a new one is running. The pages
    are zero-filled, stay so once the holder runs again, and the new client reads them."""
    # The transport's deadlines for a status frame and for progress (30 s each by default).
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "2")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    big = 4 * PAGE
    with _mooncake(request, "0", url=own_store.url) as b:
        keys = make_keys(2)
        pages = [make_page(i, big) for i in range(2)]
        assert b.put(keys, pages) == [True, True]
        log: list[str] = []
        old = b._store = _Watched(b._store, log)  # type: ignore[attr-defined]
        out = [bytearray(b"\xee" * big) for _ in keys]
        with stopped(own_store.holder_pid):
            assert b.get(keys, out) == [False, False]
            assert log == ["closed"] and b._store not in (old, None)  # type: ignore[attr-defined]
        assert out == [bytearray(big)] * 2
        s = b.stats()
        assert (s["misses_io_error"], s["client_renewals"]) == (2, 1)
        again = [bytearray(big) for _ in keys]
        assert b.get(keys, again) == [True, True]
        assert [bytes(a) for a in again] == pages
        assert out == [bytearray(big)] * 2  # the failed read never landed


def test_a_killed_segment_holder_fails_direct_reads_then_reads_work_again(
    request: pytest.FixtureRequest, own_store: MooncakeStore
) -> None:
    big = 4 * PAGE
    with _mooncake(request, "0", url=own_store.url) as b:
        keys = make_keys(2)
        assert b.put(keys[:1], [make_page(0, big)]) == [True]
        own_store.kill_holder()
        try:
            out = [bytearray(b"\xee" * big)]
            assert b.get(keys[:1], out) == [False]  # its segment is gone
            assert out[0] == bytearray(big)
            s = b.stats()
            # While the master still lists the dead segment the read fails (-800) and renews the
            # client; once it has forgotten it, the key is missing.
            assert s["misses_io_error"] + s["misses_missing"] == 1
            assert s["client_renewals"] == s["misses_io_error"]
        finally:
            own_store.start_holder()
        page = make_page(1, big)
        for _ in range(100):  # until the master places new values on the new holder only
            if b.put(keys[1:], [page]) == [True]:
                break
            time.sleep(0.1)
        again = [bytearray(big)]
        assert b.get(keys[1:], again) == [True]
        assert bytes(again[0]) == page


# ---- stalled (stopped, not dead) stores: one deadline, then calls fail fast


def _fails_fast_then_recovers(b: StorageBackend, keys: list[StorageKey], pages: list[bytes], pid: int) -> None:
    """With the store stopped, the first call is abandoned at its deadline and every later one fails
    without waiting (one deadline in all); once it runs again, calls work again."""
    untouched = bytearray(b"\xee" * len(pages[0]))
    out = [bytearray(untouched) for _ in keys]
    before = b.stats()["deadline_exceeded"]
    with stopped(pid):
        assert b.get(keys, out) == [False] * len(keys)
        assert b.exists(keys) == [False] * len(keys)
        assert b.put(keys, pages) == [False] * len(keys)
        assert b.get(keys, out) == [False] * len(keys)
        s = b.stats()
        assert s["deadline_exceeded"] == before + 1, s  # the calls after the first did not wait
        assert s["unavailable"] >= 4, s
    assert out == [untouched] * len(keys)  # nothing of the store's
    for _ in range(200):  # the abandoned call returns, the retry interval passes
        if b.exists(keys[:1]) == [True]:
            break
        time.sleep(0.05)
    again = [bytearray(len(pages[0])) for _ in keys]
    assert b.get(keys, again) == [True] * len(keys)
    assert [bytes(a) for a in again] == pages
    assert out == [untouched] * len(keys)  # the abandoned read never landed


def test_a_stalled_redis_costs_one_deadline_then_calls_fail_fast(tmp_path) -> None:
    with RedisServer(tmp_path) as server:
        b = open_storage(server.url + "?deadline=0.5&retry_s=0.3", shard=(0, 1))
        try:
            keys = make_keys(2)
            pages = [make_page(i, PAGE) for i in range(2)]
            assert b.put(keys, pages) == [True, True]
            _fails_fast_then_recovers(b, keys, pages, server.pid)
        finally:
            b.close()


@pytest.fixture(scope="module")
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a local Mooncake Store runs in a private network namespace (CI runs as root)")


@pytest.mark.needs_root
@pytest.mark.parametrize("piece", ["master", "holder"])
def test_a_stalled_mooncake_costs_one_deadline_then_calls_fail_fast(
    as_root: None, request: pytest.FixtureRequest, own_store: MooncakeStore, piece: str
) -> None:
    """A stopped master, or a stopped segment holder in the middle of a read: the call is abandoned
    at its deadline, later calls fail fast, and the abandoned read (into the staging buffer, as
    every read with a deadline) never writes into the caller's pages, also once the holder runs."""
    big = 4 * PAGE
    with _mooncake(request, "0", direct_get="0", url=own_store.url, deadline="0.5") as b:
        keys = make_keys(2)
        pages = [make_page(i, big) for i in range(2)]
        for _ in range(200):  # after a test that killed the holder, until the master forgets its segment
            if b.put(keys, pages) == [True, True]:
                break
            time.sleep(0.05)
        assert b.put(keys, pages) == [True, True]
        pid = own_store.master_pid if piece == "master" else own_store.holder_pid
        _fails_fast_then_recovers(b, keys, pages, pid)
        assert b.stats()["gets_direct"] == 0  # with a deadline, reads never land in the caller's pages
