"""TPCache in a group of pipeline stages x (context ranks x) tensor ranks: the shape is checked
against the collective, enters the round's layout check and every storage key; plain TP is as before."""

from __future__ import annotations

import threading

import pytest
import xxhash

from tpcache.comm import SimGroup
from tpcache.comm.parallel import GroupShapeError, ParallelGroup
from tpcache.core import CacheConfig
from tpcache.engine import TPCache, layout_version
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import MemoryBackend

PAGE = 4
LAYOUT = KVLayout(num_layers=2, heads_per_rank=2, head_dim=8, dtype="float16", page_size=PAGE)
CONFIG = CacheConfig(page_size=PAGE, device_pages=8, host_pages=8)


def test_a_group_that_is_not_the_collective_is_refused() -> None:
    with pytest.raises(GroupShapeError, match="PP2xTP2 needs 4 ranks, but the collective has 3"):
        TPCache(CONFIG, SimGroup(3).collective(0), kv_layout=LAYOUT, group=ParallelGroup(pp_size=2, tp_size=2))


def test_plain_tp_keeps_its_layout_version_and_a_pp_group_gets_its_own() -> None:
    # The id plain TP stores were written under: their keys must stay readable.
    old = xxhash.xxh32_intdigest(b"1/2/2/8/torch.float16/4") & 0x7FFFFFFF
    assert layout_version(LAYOUT) == layout_version(LAYOUT, group=ParallelGroup(tp_size=4)) == old
    versions = {layout_version(LAYOUT, group=ParallelGroup(pp, tp)) for pp, tp in ((2, 2), (4, 1), (2, 1))}
    assert len(versions) == 3 and old not in versions


def test_ranks_built_with_different_group_shapes_close_in_their_first_round() -> None:
    group = SimGroup(2)
    shapes = [ParallelGroup(pp_size=2, tp_size=1), ParallelGroup(pp_size=1, tp_size=2)]
    ranks = [
        TPCache(CONFIG, group.collective(r), kv_layout=LAYOUT, group=shapes[r], round_timeout_s=5.0) for r in (0, 1)
    ]
    threads = [threading.Thread(target=tp.step) for tp in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        for tp in ranks:
            assert tp.core.closed and "layout differs across ranks" in tp.core.closed_reason
    finally:
        for tp in ranks:
            tp.close()


def test_context_ranks_hold_a_share_of_each_pages_tokens_under_their_own_keys() -> None:
    shape = ParallelGroup(pp_size=2, tp_size=1, cp_size=2)  # ranks: (stage, context rank) = (r // 2, r % 2)
    half = KVLayout.from_model(4, 2, 8, 1, "float16", PAGE, pp_size=2, cp_size=2)
    assert (half.num_layers, half.heads_per_rank, half.page_size) == (2, 2, PAGE // 2)
    sim = SimGroup(4)
    for rank in range(4):
        tp = TPCache(CONFIG, sim.collective(rank), kv_layout=half, storage=MemoryBackend(), group=shape)
        try:
            assert tp.shard.rank == rank and (tp.shard.pp_rank, tp.shard.cp_rank) == divmod(rank, 2)
            key = tp.shell.key_of(0xAB).encode()
            assert f"/p{rank // 2}of2/c{rank % 2}of2/0of1/00000000000000ab" in key
            assert tp.health()["group"] == "PP2xTP1xCP2"
        finally:
            tp.close()
    with pytest.raises(ValueError, match="each of 2 context ranks holds 2 of a 4-token page"):
        TPCache(CONFIG, sim.collective(0), kv_layout=LAYOUT, group=shape)
