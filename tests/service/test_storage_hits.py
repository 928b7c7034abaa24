"""Storage hits served and counted, in every flow that serves from storage, by a group restarted
on the file store: the pages a client gets are readable at once (``get_pages`` with its lease)
and hold the bytes written before the restart; the lock reply counts what it serves, says why it
serves less than it found, and ``tpcache_hit_tokens_total{tier="storage"}`` counts what loads
brought to device. Then ``examples/client.py``, unmodified, against such a group."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.checks import fresh_tokens
from tests.service.harness import REPO, Service, repo_env, running_service, wait_for
from tests.service.test_auth_metrics import free_port_pair
from tpcache.client import AsyncClient, Client

# One worker runs the whole module, in order: its groups share one storage directory, one at a time
# (under --dist loadgroup the group name keeps the module on one worker).
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("service_storage_hits")]

PAGE = 16  # the service's default page size, as the example assumes
PAGES = 6  # each flow's prompt
PROMPT = list(range(1000))  # examples/client.py's prompt: 62 full pages
PROMPT_PAGES = len(PROMPT) // PAGE


def args(storage: Path, host_pages: int = 128, *extra: str) -> tuple[str, ...]:
    return (
        *("--page-size", str(PAGE), "--device-pages", "160", "--host-pages", str(host_pages)),
        *("--kv-layout", "L1xH1xD4:fp32", "--storage-dir", str(storage), "--write-policy", "write_through"),
        *("--heartbeat", "0.2", *extra),
    )


def write(c: Client, tokens: list[int]) -> bytes:
    """Cache ``tokens`` with random KV (every rank's share, rank-major) and wait until every rank
    made its pages durable; returns the bytes."""
    pages_n = len(tokens) // PAGE
    start = c.stats().values
    goal = {f"rank{r}.storage_written_pages": start[f"rank{r}.storage_written_pages"] + pages_n for r in range(2)}
    lk = c.lock(tokens, prefetch="none")
    pages = list(c.alloc(lk.lease, pages_n).device_page_ids)
    data = os.urandom(len(c.get_pages(pages, lease=lk.lease).data))
    c.put_pages(pages, data, lease=lk.lease)
    assert c.insert(tokens, pages, lease=lk.lease).inserted_pages == pages_n
    c.release(lk.lease)
    assert wait_for(lambda: all(c.stats().values[k] >= n for k, n in goal.items()), timeout_s=60), c.stats().values
    return data


def storage_hit_tokens(c: Client) -> int:
    return int(c.stats().values["storage_hit_tokens"])


def scrape_storage_hits(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r'^tpcache_hit_tokens_total\{tier="storage"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, list[int]], dict[str, bytes]]]:
    """A storage directory a first group wrote: one prompt per flow, and the example's."""
    tmp = tmp_path_factory.mktemp("storagehits")
    storage = tmp / "kv"
    prompts = {name: fresh_tokens(PAGES * PAGE) for name in ("lock", "best_effort", "prefetch", "async", "no_space")}
    prompts["example"] = PROMPT
    with running_service(tmp / "first", *args(storage)) as service, service.client() as c:
        data = {name: write(c, tokens) for name, tokens in prompts.items()}
    yield storage, prompts, data


@pytest.fixture(scope="module")
def restarted(
    stored: tuple[Path, dict[str, list[int]], dict[str, bytes]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, int]]:
    """A second group on the same directory (its caches empty), with metrics on ``port`` (rank 0)."""
    port = free_port_pair()
    tmp = tmp_path_factory.mktemp("restarted")
    with running_service(tmp, *args(stored[0], 128, "--metrics-port", str(port))) as service:
        yield service, port


def test_a_lock_that_cannot_read_its_storage_hit_says_why(stored, tmp_path: Path) -> None:
    storage, prompts, _ = stored
    # (First in this module: the group of ``restarted``, started after it, holds the directory.)
    # A host tier smaller than the hit: nothing is read (a storage hit is read whole or not at all).
    with running_service(tmp_path, *args(storage, PAGES - 2)) as service, service.client() as c:
        lk = c.lock(prompts["no_space"], prefetch="wait_complete")
        assert (lk.storage_pages, lk.ready_pages, lk.storage_reason) == (PAGES, 0, "no_host_space")
        assert lk.hit_tokens == 0
        assert c.hit_pages(lk) == []
        assert storage_hit_tokens(c) == 0
        c.release(lk.lease)


def test_lock_wait_complete_then_load_serves_the_written_bytes(stored, restarted) -> None:
    _, prompts, data = stored
    service, _ = restarted
    with service.client() as c:
        before = storage_hit_tokens(c)
        lk = c.lock(prompts["lock"], prefetch="wait_complete")
        assert (lk.storage_pages, lk.ready_pages, lk.storage_reason) == (PAGES, PAGES, "")
        assert lk.hit_tokens == PAGES * PAGE and (lk.device_pages, lk.host_pages) == (0, 0)
        assert storage_hit_tokens(c) == before  # read to host, not served yet
        pages = list(c.load(lk.lease).device_page_ids)
        assert len(pages) == PAGES
        # The load's reply came once the copies landed: readable at once, with the lease or without.
        assert c.get_pages(pages, lease=lk.lease).data == data["lock"]
        assert c.get_pages(pages).data == data["lock"]
        assert storage_hit_tokens(c) == before + PAGES * PAGE
        c.release(lk.lease)
        # Served once: the next lock finds them on device.
        again = c.lock(prompts["lock"])
        assert (again.device_pages, again.storage_pages, again.storage_reason) == (PAGES, 0, None)  # no lookup
        c.release(again.lease)
        assert storage_hit_tokens(c) == before + PAGES * PAGE
        assert c.stats().values["digests_equal"] is True


def test_a_best_effort_lock_serves_through_hit_pages(stored, restarted) -> None:
    _, prompts, data = stored
    service, _ = restarted
    with service.client() as c:
        before = storage_hit_tokens(c)
        lk = c.lock(prompts["best_effort"])  # the server's default: best_effort, the reply does not wait
        assert lk.storage_pages == PAGES
        assert lk.hit_tokens == lk.ready_pages * PAGE
        assert lk.storage_reason == ("" if lk.ready_pages == PAGES else "reading")
        pages = c.hit_pages(lk)
        assert len(pages) == PAGES
        assert c.get_pages(pages, lease=lk.lease).data == data["best_effort"]
        assert storage_hit_tokens(c) == before + PAGES * PAGE
        c.release(lk.lease)


def test_lock_then_prefetch_then_load(stored, restarted) -> None:
    _, prompts, data = stored
    service, _ = restarted
    with service.client() as c:
        before = storage_hit_tokens(c)
        lk = c.lock(prompts["prefetch"], prefetch="none")
        assert (lk.hit_tokens, lk.storage_pages, lk.ready_pages, lk.storage_reason) == (0, 0, None, None)
        result = c.prefetch(lk.lease, policy="wait_complete")
        assert (result.status, result.storage_pages, result.ready_pages, result.storage_reason) == (
            "done",
            PAGES,
            PAGES,
            "",
        )
        pages = list(c.load(lk.lease).device_page_ids)
        assert c.get_pages(pages, lease=lk.lease).data == data["prefetch"]
        assert storage_hit_tokens(c) == before + PAGES * PAGE
        c.release(lk.lease)


def test_the_async_client_serves_storage_hits(stored, restarted) -> None:
    _, prompts, data = stored
    service, _ = restarted

    async def serve() -> tuple[list[int], bytes]:
        async with await AsyncClient.connect(service.endpoint, timeout_s=30) as c:
            lk = await c.lock(prompts["async"])
            assert lk.storage_pages == PAGES
            pages = await c.hit_pages(lk)
            got = (await c.get_pages(pages, lease=lk.lease)).data
            await c.release(lk.lease)
            return pages, got

    pages, got = asyncio.run(serve())
    assert len(pages) == PAGES and got == data["async"]


def test_the_client_example_serves_storage_hits_with_the_bytes_written(stored, restarted) -> None:
    _, prompts, data = stored
    service, port = restarted
    with service.client() as c:
        before = storage_hit_tokens(c)
    run = subprocess.run(
        [sys.executable, "examples/client.py", service.endpoint],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    served = PROMPT_PAGES * PAGE
    assert run.stdout.splitlines()[:2] == [
        f"turn 0: {served} of 1000 tokens hit",
        f"turn 1: {served} of 1000 tokens hit",
    ]
    assert "state='open'" in run.stdout and "equal digests: True" in run.stdout
    with service.client() as c:
        # The pages the example was served stay cached: read them back, every rank's share.
        found = c.match(PROMPT)
        assert found.device_pages == PROMPT_PAGES
        assert c.get_pages(found.device_page_ids).data == data["example"]
        assert storage_hit_tokens(c) == before + served  # turn 0 from storage; turn 1 from device
    # Prometheus: the storage tier's hit tokens (published by the round loop, so wait for it).
    assert wait_for(lambda: scrape_storage_hits(port) >= before + served, timeout_s=30), scrape_storage_hits(port)
