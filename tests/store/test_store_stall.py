"""A lock whose storage lookup meets a stalled (stopped, not dead) store answers once the store's
deadline has passed, and later lookups do not wait at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service.checks import fresh_tokens
from tests.service.harness import running_service
from tpcache.testing.procs import stopped
from tpcache.testing.servers import RedisServer

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("store")]
LAYOUT = "L1xH1xD8:fp32"


def test_a_lock_on_a_stalled_store_answers_after_one_deadline(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        args = ("--page-size", "4", "--device-pages", "8", "--host-pages", "16", "--kv-layout", LAYOUT)
        args += ("--heartbeat", "0.2")
        args += ("--storage-url", server.url + "?deadline=1&retry_s=30")
        with running_service(tmp_path / "service", *args) as service, service.client(timeout_s=20.0) as c:
            looked = c.stats().values.get("storage_lookups", 0)
            # Each lookup would wait for the stopped store for ever; with the deadline the first
            # costs 1 s and the rest fail fast (retry_s 30 keeps the store marked). The client's
            # 15 s only tells an answer from a hang on a busy machine.
            with stopped(server.pid), service.client(timeout_s=15.0) as quick:
                for _ in range(3):
                    missed = quick.lock(fresh_tokens(4 * 4))
                    assert missed.storage_pages == 0
                    quick.release(missed.lease)
            assert c.stats().values["storage_lookups"] >= looked + 3  # each lock looked in the store
            assert service.proc.poll() is None
