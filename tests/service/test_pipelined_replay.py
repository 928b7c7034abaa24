"""The pipelined replay (``replay_pipelined``, the demo's ``--in-flight N``): waves of one request
are the call-at-a-time replay exactly; wider waves replay every request, keep the ranks equal and
count what they did."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from tests.service.harness import running_service
from tpcache.core import CacheConfig
from tpcache.replay import replay
from tpcache.service.replay import replay_pipelined
from tpcache.workload import SyntheticWorkload

pytestmark = pytest.mark.multiprocess

PAGE, DEVICE, HOST = 16, 512, 1536


def test_pipelined_waves_replay_every_request(tmp_path: Path) -> None:
    requests = list(islice(SyntheticWorkload(seed=3, conversations=30).requests(), 28))
    config = CacheConfig(page_size=PAGE, device_pages=DEVICE, host_pages=HOST, write_policy="write_through")
    expected, core = replay(requests, config)
    assert expected.host_hit_tokens > 0, "the workload must hit on host, so that waves load"
    args = ("--page-size", str(PAGE), "--device-pages", str(DEVICE), "--host-pages", str(HOST))
    with running_service(tmp_path, *args, "--write-policy", "write_through") as service, service.client() as c:
        one, _ = replay_pipelined(c, requests, 1)
        stats = c.stats().values
        assert (one.hit_tokens, one.device_hit_tokens, one.host_hit_tokens, one.refused_pages) == (
            expected.hit_tokens,
            expected.device_hit_tokens,
            expected.host_hit_tokens,
            expected.refused_pages,
        )
        assert stats["rank0.digest"] == core.digest.value  # waves of one: the call-at-a-time replay
        seen: list[int] = []
        wide, calls = replay_pipelined(c, requests, 8, seen.append)
        stats = c.stats().values
        assert c.health().state == "open"
    assert seen == [8, 8, 8, 4]  # every wave reported, the last one short
    assert (wide.requests, wide.input_tokens, wide.pages) == (expected.requests, expected.input_tokens, expected.pages)
    assert 0 < wide.hit_tokens <= wide.input_tokens
    assert wide.hit_tokens == wide.device_hit_tokens + wide.host_hit_tokens
    assert 3 * wide.requests <= calls <= 5 * wide.requests  # lock, insert, release; load and alloc when needed
    assert stats["digests_equal"] is True
    assert stats["leases"] == 0  # every lease of every wave released
