"""Storage across real rank processes: agreed hits survive a restart; a page on one rank is a miss."""

import pytest

from tpcache.testing.group import run_group

pytestmark = pytest.mark.multiprocess


def test_restarted_group_hits_what_was_durable_and_nothing_else(tmp_path):
    wrote = run_group(2, "storage_restart", {"storage_dir": str(tmp_path), "phase": "write"}, transport="torch")
    assert [w["durable"] for w in wrote] == [4, 4]  # 3 + 1 distinct pages of the two stored paths
    read = run_group(2, "storage_restart", {"storage_dir": str(tmp_path), "phase": "read"}, transport="torch")
    assert read[0]["ready"] == read[1]["ready"] == [3, 1, 0]  # path 2 shares 2 pages already on host
    assert read[0]["digest"] == read[1]["digest"]


def test_a_page_stored_on_only_one_rank_never_counts_as_a_hit(tmp_path):
    run_group(2, "storage_restart", {"storage_dir": str(tmp_path), "phase": "write"})
    read = run_group(2, "storage_restart", {"storage_dir": str(tmp_path), "phase": "read", "lose_on_rank": 1})
    # Rank 1 lost page 1 of path 1: both ranks read only page 0 of it, then page 2 of path 2 is
    # unreachable (its parent page 1 is missing), so path 2 fetches nothing beyond what is held.
    assert read[0]["ready"] == read[1]["ready"]
    assert read[0]["ready"][0] == 1
    assert read[0]["digest"] == read[1]["digest"]
