"""The vLLM connector's start-up agreement on real rank processes (gloo over 127.0.0.1), without
vLLM: ranks that read different free memory build the same cache, which stays open."""

import pytest

from tpcache.testing.group import run_group

pytestmark = pytest.mark.multiprocess

MIB = 1 << 20
READINGS = [40 * MIB, 39 * MIB]  # two ranks' free memory, read a moment apart


def test_ranks_sizing_the_host_tier_from_their_own_reading_close_the_cache() -> None:
    """What the agreement prevents: the sizes differ, so the configurations do, and round 1 closes."""
    results = run_group(2, "connector_settings", {"readings": READINGS, "agree": False})
    assert results[0]["pages"] != results[1]["pages"]
    assert all("layout differs across ranks" in r["closed"] for r in results), results


def test_ranks_agree_on_the_least_reading_and_the_cache_stays_open() -> None:
    results = run_group(2, "connector_settings", {"readings": READINGS})
    assert results[0]["pages"] == results[1]["pages"] == int(39 * MIB * 0.1) // 2 // 512
    assert [r["closed"] for r in results] == ["", ""]
    assert results[0]["line"] == results[1]["line"]
    assert "available: rank 0 40 MiB, rank 1 39 MiB" in results[0]["line"]


def test_explicit_settings_that_differ_stop_every_rank_with_one_line() -> None:
    args = {"readings": READINGS, "extra": {"host_pages": 64}, "rank_extra": {"1": {"round_timeout_s": 5.0}}}
    results = run_group(2, "connector_settings", args)
    line = (
        "kv_connector_extra_config: settings that must be equal on every TP rank differ: "
        "round_timeout_s (rank 0 30.0, rank 1 5.0)"
    )
    assert results == [{"error": line}, {"error": line}]


def test_ranks_holding_different_storage_keys_stop_together_with_one_line(tmp_path) -> None:
    keys = ["a deployment secret of 32 bytes!", "another secret, also long enough"]
    args = {"readings": READINGS, "extra": {"storage_dir": str(tmp_path)}, "keys": keys}
    results = run_group(2, "connector_settings", args)
    line = (
        "TPCACHE_STORAGE_KEY: the storage key must be the same on every TP rank; "
        "it differs (rank 0 key A, rank 1 key B)"
    )
    assert results == [{"error": line}, {"error": line}]


def test_a_storage_key_too_short_on_one_rank_stops_every_rank_instead_of_a_timeout(tmp_path) -> None:
    keys = ["a deployment secret of 32 bytes!", "short"]
    args = {"readings": READINGS, "extra": {"storage_dir": str(tmp_path)}, "keys": keys}
    results = run_group(2, "connector_settings", args)
    ends = [r.get("error", "").endswith("the same on every TP rank; shorter on rank 1") for r in results]
    assert ends == [True, True], results
