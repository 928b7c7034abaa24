"""Real rank processes on gloo over 127.0.0.1: agreement under rank-local completion jitter."""

import pytest

from tpcache.testing.group import GroupFailed, run_group

pytestmark = pytest.mark.multiprocess


def assert_agree(results: list[dict]) -> None:
    first = results[0]
    for r in results[1:]:
        assert r["digest"] == first["digest"]
        assert r["probes"] == first["probes"]  # same hits, same page numbers, on every rank
        assert r["rounds"] == first["rounds"]
    for r in results:
        assert r["closed"] is None
        assert r["calls"] == r["rounds"]  # exactly one collective per round
        assert r["leases"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_under_jitter_on_the_fast_transport(world):
    results = run_group(world, "random_workload", {"seed": 11 + world, "steps": 60, "jitter_s": 0.003})
    assert_agree(results)
    assert results[0]["transport"] == "shm"
    assert sum(r["backups"] for r in results) > 0
    assert any(p[0] or p[1] for p in results[0]["probes"])  # the workload really hit


def test_ranks_agree_on_gloo():
    results = run_group(2, "random_workload", {"seed": 5, "steps": 40}, transport="torch")
    assert_agree(results)
    assert results[0]["transport"] == "gloo"


def test_a_diverged_rank_closes_every_rank_in_the_same_round():
    results = run_group(3, "random_workload", {"seed": 9, "steps": 30, "diverge_at": 12})
    for r in results:
        assert r["closed_at"] == 12
        assert "state_digest differs" in r["closed"]
        assert all(p == (0, 0, []) for p in r["probes"][12:])  # closed: misses only


def test_a_dead_rank_closes_the_survivors_instead_of_hanging():
    results = run_group(
        3,
        "random_workload",
        {"seed": 3, "steps": 30, "die_at": 8, "round_timeout_s": 3.0},
        timeout_s=90,
        allow_dead=True,
    )
    assert results[2] is None  # it crashed
    for r in results[:2]:
        # Closed by the round the rank died in, never later. A machine that starves the dying rank
        # past the round timeout before it dies closes them a round earlier, for the same reason.
        assert r["closed_at"] is not None and r["closed_at"] <= 8
        assert "collective failed" in r["closed"]


def test_a_crashing_rank_is_reported_not_hung():
    with pytest.raises(GroupFailed, match="rank 1 exited"):
        run_group(2, "random_workload", {"seed": 4, "steps": 10, "die_at": 2, "round_timeout_s": 3.0}, timeout_s=60)
