"""A PP2 x TP2 group of four real rank processes: each rank's slice through host and storage, keys
per (stage, tensor rank), a hit only where all four slices are valid, a killed rank closes all."""

import re

import pytest

from tpcache.io.storage import StorageKey
from tpcache.testing.group import run_group
from tpcache.testing.group_scenarios import GROUP

pytestmark = pytest.mark.multiprocess

KILLED, DAMAGED = 2, 3  # stage 1 tensor rank 0 dies; stage 1 tensor rank 1 lost a byte of one slice


def test_a_pp2_x_tp2_group_stores_slices_hits_only_whole_pages_and_closes_when_a_rank_dies(tmp_path):
    args = {"storage_dir": str(tmp_path), "damage_rank": DAMAGED, "kill_rank": KILLED}
    results = run_group(4, "pp_tp_group", args, timeout_s=120, allow_dead=True)
    assert results[KILLED] is None  # it died as planned, after its own slice checks passed
    survivors = {r: results[r] for r in range(4) if r != KILLED}
    for rank, res in survivors.items():
        assert res["written"] == 6  # both paths' 3 pages, this rank's slice of each, durable
        assert res["damaged"] == (1 if rank == DAMAGED else 0)
        # Page 1 of the first path is unreadable on one rank of one stage: that page and the one
        # after it miss on every rank; the second path hits whole.
        assert res["ready"] == [1, 3]
        assert res["misses_corrupt"] == (1 if rank == DAMAGED else 0)  # counted where it was found
        assert res["health"]["group"] == "PP2xTP2"
        assert (res["health"]["stage"], res["health"]["tp_rank"]) == (rank // 2, rank % 2)
        # Killed rank on stage 1: every survivor, stage 0 included, closed and serves misses.
        assert res["health"]["state"] == "closed"
        assert "collective" in res["health"]["reason"]
        assert res["hit_after_kill"] == 0
    assert (
        survivors[0]["holds"]
        == "PP2xTP2 rank 0: stage 0 of 2 (layers 0-1 of 4), tensor rank 0 of 2 (KV heads 0-1 of 4)"
    )
    assert (
        survivors[3]["holds"]
        == "PP2xTP2 rank 3: stage 1 of 2 (layers 2-3 of 4), tensor rank 1 of 2 (KV heads 2-3 of 4)"
    )
    # On disk: each rank's records sit under its own (stage, tensor rank) and carry it in their keys.
    labels = set()
    for rank in range(4):
        shard = GROUP.place(rank)
        segments = list((tmp_path / f"rank{rank}" / shard.label).glob("*.seg"))
        assert segments, rank
        keys = {
            StorageKey.decode(k.decode())
            for seg in segments
            for k in re.findall(rb"v1/[!-~]+?/[0-9a-f]{16}", seg.read_bytes())
        }
        assert len(keys) == 6 and {k.shard for k in keys} == {shard}
        labels.add(shard.label)
    assert labels == {"p0of2.r0of2", "p0of2.r1of2", "p1of2.r0of2", "p1of2.r1of2"}
