"""The storage tier through the protocol: what a client wrote and the ranks made durable is found
again (match and lock report it, prefetch reads it to host, load to device) by a group restarted
on the same directory, with the bytes the client wrote; a damaged record is a miss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import protocol as p
from tests.service.checks import fresh_tokens
from tests.service.harness import Service, running_service, wait_for
from tpcache.client import Client

pytestmark = pytest.mark.multiprocess

LAYOUT = "L2xH2xD8:fp32"
PAGE, PAGES = 4, 8


def args(storage: Path) -> tuple[str, ...]:
    return (
        *("--page-size", str(PAGE), "--device-pages", "32", "--host-pages", "64", "--kv-layout", LAYOUT),
        *("--storage-dir", str(storage), "--write-policy", "write_through", "--heartbeat", "0.2"),
    )


def write(c: Client, tokens: list[int]) -> bytes:
    """Insert ``tokens`` with random KV and wait until every rank made each of its pages durable
    (counted from before this write: an earlier write's pages do not count for it)."""
    start = c.stats().values
    goal = {f"rank{r}.storage_written_pages": start[f"rank{r}.storage_written_pages"] + PAGES for r in range(2)}
    lk = c.lock(tokens, prefetch="none")
    pages = list(c.alloc(lk.lease, PAGES).device_page_ids)
    data = os.urandom(len(c.get_pages(pages, lease=lk.lease).data))
    c.put_pages(pages, data, lease=lk.lease)
    assert c.insert(tokens, pages, lease=lk.lease).inserted_pages == PAGES
    c.release(lk.lease)

    def written() -> bool:
        values = c.stats().values
        return all(values[key] >= n for key, n in goal.items())

    durable = wait_for(written, timeout_s=60)
    assert durable, c.stats().values
    return data


def read_back(service: Service, c: Client, tokens: list[int]) -> tuple[int, int, bytes]:
    """lock with a storage prefetch, then load (its reply comes once the pages are on device);
    returns (storage pages, pages that reached the device, their bytes)."""
    lk = c.lock(tokens, prefetch="wait_complete")
    assert lk.device_pages == lk.host_pages == 0  # nothing of it was cached before
    assert lk.hit_tokens == lk.ready_pages * PAGE  # what was read to host is served
    # Every page found is read, or the reply says why not.
    assert lk.ready_pages == lk.storage_pages or lk.storage_reason == "read_failed", lk
    loaded = list(c.load(lk.lease).device_page_ids)
    assert len(loaded) == lk.ready_pages
    data = c.get_pages(loaded, lease=lk.lease).data if loaded else b""
    c.release(lk.lease)
    return lk.storage_pages, len(loaded), data


def rank_share(data: bytes, pages: int, total: int) -> bytes:
    """The first ``pages`` pages of every rank's share of ``data`` (``total`` pages, rank-major)."""
    share = len(data) // 2
    size = share // total
    return b"".join(data[r * share : r * share + pages * size] for r in range(2))


def test_a_restarted_group_serves_what_was_durable(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    tokens, later = fresh_tokens(PAGES * PAGE), fresh_tokens(PAGES * PAGE)
    with running_service(tmp_path / "first", *args(storage)) as service, service.client() as c:
        data = write(c, tokens)
        write(c, later)
        assert c.match(tokens, storage=True).device_pages == PAGES  # cached: nothing to look up
    with running_service(tmp_path / "second", *args(storage)) as service, service.client() as c:
        assert c.match(tokens).hit_tokens == 0
        found = c.match(tokens, storage=True)
        assert (found.hit_tokens, found.storage_pages) == (0, PAGES)
        assert c.match(tokens).host_pages == 0  # a lookup reads nothing
        stored, loaded, got = read_back(service, c, tokens)
        assert (stored, loaded) == (PAGES, PAGES)
        assert got == data  # the bytes the client wrote, from every rank's own storage
        # The runtime setting, agreed by every rank: off, lock looks nothing up; prefetch still can.
        assert c.set_config(storage_prefetch=False).settings["storage_prefetch"] is False
        lk = c.lock(later)
        assert lk.storage_pages == 0
        with service.client() as other, pytest.raises(p.NotFound):
            other.prefetch(lk.lease)  # not its lease
        result = c.prefetch(lk.lease, policy="wait_complete")
        assert (result.status, result.storage_pages, result.ready_pages) == ("done", PAGES, PAGES)
        assert c.match(later).host_pages == PAGES  # read to host, agreed on every rank
        c.release(lk.lease)
        assert c.set_config(storage_prefetch=True).settings["storage_prefetch"] is True
        stats = c.stats().values
        assert stats["storage_prefetch_hit_tokens"] >= 2 * PAGES * PAGE and stats["storage_lookups"] >= 3
        assert stats["storage_hit_tokens"] == PAGES * PAGE  # what a load served, not what was only read
        assert stats["digests_equal"] is True


def test_a_damaged_record_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    tokens = fresh_tokens(PAGES * PAGE)
    with running_service(tmp_path / "first", *args(storage)) as service, service.client() as c:
        data = write(c, tokens)
    segments = sorted(p for p in (storage / "rank1").rglob("*.seg") if p.stat().st_size)
    assert segments, list(storage.rglob("*"))
    damaged = segments[-1]
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0xFF  # inside the payload of the last record written
    damaged.write_bytes(bytes(raw))
    with running_service(tmp_path / "second", *args(storage)) as service, service.client() as c:
        stored, loaded, got = read_back(service, c, tokens)
        assert loaded < PAGES, "a damaged record was read as a hit"
        assert got == rank_share(data, loaded, PAGES)  # every page served is the page written
        assert c.stats().values["digests_equal"] is True
