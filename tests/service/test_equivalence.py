"""The main job's check: the same workload through the 2-rank service and through the
single-rank core replay gives exactly the same hit tokens (per tier) and the same final state."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from tests.service.harness import running_service
from tpcache.core import CacheConfig
from tpcache.replay import replay
from tpcache.service.replay import replay_through_service
from tpcache.workload import SyntheticWorkload

pytestmark = pytest.mark.multiprocess

# Small tiers so that the workload evicts from device to host and hits on both tiers.
PAGE, DEVICE, HOST = 16, 512, 1536


def test_service_and_single_rank_replay_agree(tmp_path: Path) -> None:
    requests = list(islice(SyntheticWorkload(seed=3, conversations=30).requests(), 90))
    requests += [requests[-1]] * 2  # requests that hit every full page: no alloc, same state
    config = CacheConfig(page_size=PAGE, device_pages=DEVICE, host_pages=HOST, write_policy="write_through")
    expected, core = replay(requests, config)
    assert expected.host_hit_tokens > 0 and expected.device_hit_tokens > 0, "the workload must use both tiers"
    args = ("--page-size", str(PAGE), "--device-pages", str(DEVICE), "--host-pages", str(HOST))
    with running_service(tmp_path, *args, "--write-policy", "write_through") as service, service.client() as c:
        got, _ = replay_through_service(c, requests)
        stats = c.stats().values
    assert (got.hit_tokens, got.device_hit_tokens, got.host_hit_tokens) == (
        expected.hit_tokens,
        expected.device_hit_tokens,
        expected.host_hit_tokens,
    )
    assert (got.requests, got.input_tokens, got.refused_pages) == (
        expected.requests,
        expected.input_tokens,
        expected.refused_pages,
    )
    assert stats["digests_equal"] is True
    assert stats["rank0.digest"] == core.digest.value  # the same final state as the single rank
