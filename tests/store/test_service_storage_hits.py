"""Storage hits through the service on the remote stores (redis-server, Mooncake Store): a group
restarted on the store serves what the first one wrote, readable as soon as ``load`` replies,
with the bytes written, and counts them as tier storage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service.harness import running_service, wait_for
from tests.store.conftest import BACKENDS, store_url
from tpcache.client import Client

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("store")]

PAGE, PAGES = 4, 6


def args(url: str) -> tuple[str, ...]:
    return (
        *("--page-size", str(PAGE), "--device-pages", "32", "--host-pages", "32", "--kv-layout", "L1xH1xD4:fp32"),
        *("--storage-url", url, "--write-policy", "write_through", "--heartbeat", "0.2"),
    )


def write(c: Client, tokens: list[int]) -> bytes:
    lk = c.lock(tokens, prefetch="none")
    pages = list(c.alloc(lk.lease, PAGES).device_page_ids)
    data = os.urandom(len(c.get_pages(pages, lease=lk.lease).data))
    c.put_pages(pages, data, lease=lk.lease)
    assert c.insert(tokens, pages, lease=lk.lease).inserted_pages == PAGES
    c.release(lk.lease)
    durable = wait_for(
        lambda: all(c.stats().values[f"rank{r}.storage_written_pages"] >= PAGES for r in range(2)), timeout_s=60
    )
    assert durable, c.stats().values
    return data


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restarted_service_serves_storage_hits(
    request: pytest.FixtureRequest, backend: str, namespace: str, tmp_path: Path
) -> None:
    sep = "&" if "?" in store_url(request, backend) else "?"
    url = f"{store_url(request, backend)}{sep}prefix={namespace}/"
    tokens = list(range(7, 7 + PAGES * PAGE))
    with running_service(tmp_path / "first", *args(url)) as service, service.client() as c:
        data = write(c, tokens)
    with running_service(tmp_path / "second", *args(url)) as service, service.client() as c:
        lk = c.lock(tokens, prefetch="wait_complete")
        assert (lk.storage_pages, lk.ready_pages, lk.storage_reason, lk.hit_tokens) == (PAGES, PAGES, "", PAGES * PAGE)
        pages = c.hit_pages(lk)
        assert len(pages) == PAGES
        assert c.get_pages(pages, lease=lk.lease).data == data
        c.release(lk.lease)
        stats = c.stats().values
        assert stats["storage_hit_tokens"] == PAGES * PAGE and stats["digests_equal"] is True
