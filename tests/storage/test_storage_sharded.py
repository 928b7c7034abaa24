"""The shared storage layout: pages stored as shards of the model's KV heads and layers, written by a
group of one shape and read by groups of others, whole sets only."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tpcache.comm import SimGroup
from tpcache.comm.parallel import ParallelGroup, Shard
from tpcache.core import CacheConfig
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import StorageKey, StorageKeyError
from tpcache.io.storage.sharded import ModelShape, ShardedStorage, ShardLayoutError, open_shared_storage
from tpcache.io.storage.shared_file import SharedFileStore
from tpcache.testing.waits import prefetched

PAGE = 4
LAYERS, HEADS, DIM = 4, 4, 8
DTYPE = torch.float16
MODEL_ID = "tiny-4h"
CONFIG = CacheConfig(page_size=PAGE, device_pages=16, host_pages=16, write_policy="write_through", storage=True)


def rank_layout(shape: ParallelGroup) -> KVLayout:
    return KVLayout.from_model(LAYERS, HEADS, DIM, shape.tp_size, DTYPE, PAGE, pp_size=shape.pp_size)


def model() -> ModelShape:
    return ModelShape.of_rank(MODEL_ID, rank_layout(ParallelGroup(tp_size=1)), Shard(0, 1))


def whole_page(page_hash: int) -> torch.Tensor:
    """The model's KV of one page, ``[layers, 2, page, heads, dim]``: a function of the page alone."""
    g = torch.Generator().manual_seed(page_hash & 0x7FFFFFFF)
    raw = torch.randint(0, 256, (LAYERS * 2 * PAGE * HEADS * DIM * 2,), dtype=torch.uint8, generator=g)
    return raw.view(DTYPE).view(LAYERS, 2, PAGE, HEADS, DIM)


def rank_slice(page_hash: int, shape: ParallelGroup, rank: int) -> torch.Tensor:
    """Rank ``rank``'s bytes of the page: its stage's layers, its tensor rank's heads (canonical order)."""
    s, lay = shape.place(rank), rank_layout(shape)
    lo, ho = s.pp_rank * lay.num_layers, s.tp_rank * lay.heads_per_rank
    part = whole_page(page_hash)[lo : lo + lay.num_layers, :, :, ho : ho + lay.heads_per_rank]
    return part.contiguous().view(-1).view(torch.uint8)


def tokens(*pages: int) -> list[int]:
    return [v * 1000 + i for v in pages for i in range(PAGE)]


def on_group(
    shape: ParallelGroup, url: str, fn: Callable[[TPCache], Any], model_id: str = MODEL_ID, **kw: Any
) -> list[Any]:
    """Build a group of ``shape`` on the shared layout at ``url``, run ``fn`` on every rank at once."""
    sim = SimGroup(shape.world_size)
    ranks = [
        TPCache(
            CONFIG,
            sim.collective(r),
            kv_layout=rank_layout(shape),
            storage=url,
            group=shape,
            model_id=model_id,
            round_timeout_s=30.0,
            **kw,
        )
        for r in range(shape.world_size)
    ]
    out: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(ranks[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
    finally:
        for tp in ranks:
            tp.close()
    return out


def write(tp: TPCache, toks: list[int]) -> None:
    """An engine's request: compute this rank's KV of every page, insert, release."""
    lease, m = tp.lock(toks)
    fresh = tp.alloc(lease, len(m.page_hashes))
    for page, h in zip(fresh, m.page_hashes, strict=True):
        tp.device_pool.write_page(page, rank_slice(h, tp.group, tp.rank))
    tp.insert(lease, toks, fresh)
    tp.release(lease)
    tp.step()


def read(tp: TPCache, toks: list[int]) -> dict[str, Any]:
    """Look ``toks`` up in storage, read the agreed hit to host; what landed, byte-checked."""
    lease, m = tp.lock(toks)
    assert m.device_pages + m.host_pages == 0
    assert tp.prefetch(lease)
    status = prefetched(tp, lease)
    m = tp.match(toks)
    exact = all(
        torch.equal(tp.host_pool.read_page(node.host_slot), rank_slice(node.hash, tp.group, tp.rank))
        for node in (tp.core.tree.nodes[i] for i in m.nodes[m.device_pages : m.device_pages + m.host_pages])
    )
    tp.release(lease)
    tp.drain()
    return {"status": status, "host": m.host_pages, "exact": exact, "stats": tp.storage.stats()}


READERS = [ParallelGroup(tp_size=1), ParallelGroup(tp_size=4), ParallelGroup(pp_size=2, tp_size=1)]


def test_shard_keys_name_the_model_and_its_ranges_never_a_place() -> None:
    key = StorageKey("llama", 77, 0, 1, 0xAB, layers=(0, 7), heads=(2, 2))
    assert key.encode() == "v2/n_llama/77/l0-7.h2-2/00000000000000ab"
    assert StorageKey.decode(key.encode()) == key
    assert key.encode() != StorageKey("llama", 77, 0, 1, 0xAB).encode()
    for bad in ("v2/n_llama/77/l0-7.h02-2/00000000000000ab", "v2/n_llama/77/l0-7/00000000000000ab"):
        with pytest.raises(StorageKeyError):
            StorageKey.decode(bad)
    with pytest.raises(StorageKeyError, match="last of heads"):
        StorageKey("llama", 77, 0, 1, 0xAB, layers=(0, 7), heads=(3, 2))
    with pytest.raises(StorageKeyError, match="model ranges, not a rank's place"):
        StorageKey("llama", 77, 1, 2, 0xAB, layers=(0, 7), heads=(2, 2))


def test_the_shard_granularity_serves_every_shape_that_divides_it_and_refuses_the_rest() -> None:
    m = model()
    assert (m.heads_per_shard, m.layers_per_shard) == (1, 1)  # gcd(4 layers, 4) = 4 blocks
    for shape in (ParallelGroup(tp_size=2), *READERS):
        ranges = m.ranges(rank_layout(shape), shape.place(0))
        assert len(ranges) == (LAYERS // shape.pp_size) * (HEADS // shape.tp_size)
    big = ModelShape("m", 32, 8, 128, torch.bfloat16, 16, layers_per_shard=8)
    with pytest.raises(ShardLayoutError, match="splits the model's shards of 8 layer"):
        big.ranges(KVLayout.from_model(32, 8, 128, 1, torch.bfloat16, 16, pp_size=8), Shard(0, 1, 0, 8))
    with pytest.raises(ShardLayoutError, match="context-parallel"):
        ModelShape.of_rank("m", rank_layout(ParallelGroup()), Shard(0, 1, 0, 1, 0, 2))
    with pytest.raises(ShardLayoutError, match="model id"):
        ModelShape("", 4, 4, 8, torch.float16, 4)
    # Another model (or dtype, or granularity) is another layout id: its keys never meet these.
    ids = {m.layout_id, ModelShape(MODEL_ID, 4, 4, 8, torch.bfloat16, 4).layout_id}
    ids.add(ModelShape(MODEL_ID, 4, 4, 8, torch.float16, 4, heads_per_shard=2).layout_id)
    assert len(ids) == 3


def cross_shape(url: str, remove: Callable[[StorageKey], int], model_id: str = MODEL_ID) -> None:
    """A TP=2 group writes; TP=1, TP=4 and PP2xTP1 groups read every page byte-exact; one shard is
    removed (``remove``: from wherever it is stored, how many copies went); then that page is a miss
    on every rank of every reader shape, even on ranks whose own shards are all there."""
    writer = ParallelGroup(tp_size=2)
    wrote = on_group(writer, url, lambda tp: (write(tp, tokens(1, 2, 3)), tp.drain(), tp.core.stats)[2], model_id)
    assert [s.storage_written_pages for s in wrote] == [3, 3]
    for shape in READERS:
        got = on_group(shape, url, lambda tp: read(tp, tokens(1, 2, 3)), model_id)
        for r in got:
            assert (r["status"], r["host"], r["exact"]) == (("done", 3), 3, True), shape.name
            assert r["stats"]["page_hits"] == 3 and r["stats"]["page_partial"] == 0
    page2 = on_group(ParallelGroup(tp_size=1), url, lambda tp: tp.match(tokens(1, 2)).page_hashes[1], model_id)[0]
    lost = StorageKey(model_id, model().layout_id, 0, 1, page2, layers=(0, 0), heads=(3, 3))  # head 3, layer 0
    assert remove(lost) >= 1
    for shape in READERS:
        got = on_group(shape, url, lambda tp: read(tp, tokens(1, 2, 3)), model_id)
        assert [(r["status"], r["host"], r["exact"]) for r in got] == [(("done", 1), 1, True)] * shape.world_size
    partial = on_group(
        ParallelGroup(tp_size=4), url, lambda tp: read(tp, tokens(1, 2, 3))["stats"]["page_partial"], model_id
    )
    assert partial == [0, 0, 0, 1]  # only the rank of head 3 saw the set incomplete; all four missed


def test_a_tp2_store_is_read_byte_exact_by_tp1_tp4_and_pp2_and_a_lost_shard_misses_everywhere(
    tmp_path: Path,
) -> None:
    def remove(key: StorageKey) -> int:
        removed = 0
        for owner in sorted(p.name for p in (tmp_path / "model").iterdir()):
            store = SharedFileStore(tmp_path / "model", owner, capacity_bytes=1 << 24)
            removed += store.delete([key])[0]
            store.close()
        return removed

    cross_shape(f"file://{tmp_path}", remove)


def test_a_reader_sees_a_writers_new_records_and_a_removed_segment_is_a_miss(tmp_path: Path) -> None:
    lay = rank_layout(ParallelGroup(tp_size=2))
    m = model()
    writer = ShardedStorage(SharedFileStore(tmp_path, "r0of2", capacity_bytes=1 << 24), m, Shard(0, 2), lay)
    reader_lay = rank_layout(ParallelGroup(tp_size=4))
    reader = ShardedStorage(SharedFileStore(tmp_path, "r0of4", capacity_bytes=1 << 24), m, Shard(0, 4), reader_lay)
    try:
        shape2, shape4 = ParallelGroup(tp_size=2), ParallelGroup(tp_size=4)
        keys = [StorageKey("ns", 1, 0, 2, h) for h in (11, 12)]
        out = [torch.zeros(reader_lay.page_bytes, dtype=torch.uint8) for _ in keys]
        rkeys = [StorageKey("ns", 1, 0, 4, h) for h in (11, 12)]
        assert reader.exists(rkeys) == [False, False]
        assert writer.put(keys[:1], [rank_slice(11, shape2, 0)]) == [True]  # the writer is still open
        assert reader.exists(rkeys) == [True, False]
        assert reader.get(rkeys[:1], out[:1]) == [True] and torch.equal(out[0], rank_slice(11, shape4, 0))
        assert writer.put(keys[1:], [rank_slice(12, shape2, 0)]) == [True]
        assert reader.get(rkeys, out) == [True, True] and torch.equal(out[1], rank_slice(12, shape4, 0))
        for seg in (tmp_path / "r0of2").glob("*.seg"):
            seg.unlink()
        assert reader.get(rkeys, out) == [False, False]
        assert not out[0].any() and not out[1].any()
    finally:
        writer.close()
        reader.close()


def test_a_hybrid_model_and_a_context_parallel_group_are_refused_in_one_line(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    with pytest.raises(ValueError, match="hybrid model's components"):
        TPCache(
            CONFIG,
            SimGroup(1).collective(0),
            kv_layout=rank_layout(ParallelGroup()),
            storage=url,
            model_id=MODEL_ID,
            part_layouts={"swa": rank_layout(ParallelGroup())},
        )
    half = KVLayout.from_model(LAYERS, HEADS, DIM, 1, DTYPE, PAGE, cp_size=2)
    with pytest.raises(ValueError, match="context-parallel"):
        TPCache(
            CONFIG,
            SimGroup(2).collective(0),
            kv_layout=half,
            storage=url,
            group=ParallelGroup(cp_size=2),
            model_id=MODEL_ID,
        )


def test_another_models_store_and_records_without_the_storage_key_are_misses(tmp_path: Path) -> None:
    from tpcache.io.storage import RecordMac

    shape2, shape1 = ParallelGroup(tp_size=2), ParallelGroup(tp_size=1)
    lay2, lay1 = rank_layout(shape2), rank_layout(shape1)
    writers = [
        ShardedStorage(SharedFileStore(tmp_path, f"r{r}of2", capacity_bytes=1 << 24), model(), Shard(r, 2), lay2)
        for r in range(2)
    ]
    writers[0].authenticate(RecordMac(b"k" * 16))  # rank 0's shards signed, rank 1's not
    for r, w in enumerate(writers):
        assert w.put([StorageKey("ns", 1, r, 2, 5)], [rank_slice(5, shape2, r)]) == [True]
        w.close()
    key, out = [StorageKey("ns", 1, 0, 1, 5)], [torch.zeros(lay1.page_bytes, dtype=torch.uint8)]

    def reader(m: ModelShape, mac: bytes | None) -> ShardedStorage:
        store = ShardedStorage(SharedFileStore(tmp_path, "r0of1", capacity_bytes=1 << 24), m, Shard(0, 1), lay1)
        if mac is not None:
            store.authenticate(RecordMac(mac))
        return store

    plain = reader(model(), None)  # checksums only: the whole page
    assert plain.get(key, out) == [True] and torch.equal(out[0], rank_slice(5, shape1, 0))
    plain.close()
    keyed = reader(model(), b"k" * 16)  # rank 1's unsigned shards fail: the page is a miss
    assert keyed.exists(key) == [True] and keyed.get(key, out) == [False] and not out[0].any()
    assert keyed.stats()["misses_unauthenticated"] == 8 and keyed.stats()["page_partial"] == 1
    keyed.close()
    other = reader(ModelShape("another-model", LAYERS, HEADS, DIM, DTYPE, PAGE), None)
    assert other.exists(key) == [False] and other.get(key, out) == [False]
    other.close()


def test_pipeline_stages_write_their_layers_and_a_tp4_group_reads_every_head(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    writer = ParallelGroup(pp_size=2, tp_size=2)
    on_group(writer, url, lambda tp: (write(tp, tokens(7, 8)), tp.drain()))
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "p0of2.r0of2",
        "p0of2.r1of2",
        "p1of2.r0of2",
        "p1of2.r1of2",
    ]
    for shape in (ParallelGroup(tp_size=4), ParallelGroup(tp_size=1)):
        got = on_group(shape, url, lambda tp: read(tp, tokens(7, 8)))
        assert [(r["status"], r["exact"]) for r in got] == [(("done", 2), True)] * shape.world_size


def shared_pair(tmp_path: Path) -> tuple[SharedFileStore, SharedFileStore, list[StorageKey], list[torch.Tensor]]:
    """Owner "a" with two records of its own (k1, k2, in its active segment), and reader "b"."""
    a = SharedFileStore(tmp_path, "a", capacity_bytes=1 << 24)
    b = SharedFileStore(tmp_path, "b", capacity_bytes=1 << 24)
    keys = [StorageKey("ns", 1, 0, 1, h) for h in (21, 22)]
    pages = [torch.full((64,), h, dtype=torch.uint8) for h in (21, 22)]
    assert a.put(keys[:1], pages[:1]) == [True]
    return a, b, keys, pages


def test_a_peer_record_seen_half_written_is_found_once_whole(tmp_path: Path) -> None:
    a, b, keys, pages = shared_pair(tmp_path)
    try:
        (seg,) = (tmp_path / "a").glob("*.seg")
        one = seg.stat().st_size
        assert a.put(keys[1:], pages[1:]) == [True]
        whole = seg.read_bytes()
        os.truncate(seg, one + (len(whole) - one) // 2)  # k2 as a reader may see it while it is written
        out = [torch.zeros(64, dtype=torch.uint8) for _ in keys]
        assert b.get(keys, out) == [True, False] and torch.equal(out[0], pages[0])
        with open(seg, "ab") as f:  # the rest of k2 lands
            f.write(whole[seg.stat().st_size :])
        assert b.get(keys, out) == [True, True] and torch.equal(out[1], pages[1])
    finally:
        a.close()
        b.close()


def test_a_peer_record_that_failed_to_read_once_is_read_again(tmp_path: Path) -> None:
    a, b, keys, pages = shared_pair(tmp_path)
    try:
        out = [torch.zeros(64, dtype=torch.uint8)]
        assert b.get(keys[:1], out) == [True] and torch.equal(out[0], pages[0])
        (seg,) = (tmp_path / "a").glob("*.seg")
        aside = seg.with_suffix(".aside")
        seg.rename(aside)
        seg.mkdir()  # opens, but reading it fails: an I/O error, not a missing record
        assert b.get(keys[:1], out) == [False] and not out[0].any()
        assert b.stats()["misses_io_error"] == 1
        seg.rmdir()
        aside.rename(seg)
        assert b.get(keys[:1], out) == [True] and torch.equal(out[0], pages[0])
    finally:
        a.close()
        b.close()


def test_two_groups_of_one_shape_share_a_directory_and_a_restart_takes_its_own_again(tmp_path: Path) -> None:
    url, shape = f"file://{tmp_path}", ParallelGroup(tp_size=2)
    lay, m = rank_layout(shape), ModelShape.of_rank(MODEL_ID, rank_layout(shape), Shard(0, 2))

    def rank0() -> ShardedStorage:
        return open_shared_storage(url, model=m, shard=Shard(0, 2), layout=lay, capacity_bytes=1 << 24)

    first, second = rank0(), rank0()  # rank 0 of two data-parallel replicas
    key = StorageKey("ns", 1, 0, 2, 31)
    out = torch.zeros(lay.page_bytes, dtype=torch.uint8)
    try:
        assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["r0of2", "r0of2.i1"]
        assert second.put([key], [rank_slice(31, shape, 0)]) == [True]
        assert first.get([key], [out]) == [True] and torch.equal(out, rank_slice(31, shape, 0))
        second.close()
        second = rank0()  # the second replica restarts: its own directory again, with its records
        assert second.stats()["records"] >= 1
        assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["r0of2", "r0of2.i1"]
    finally:
        first.close()
        second.close()
