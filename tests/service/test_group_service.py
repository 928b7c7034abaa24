"""The service as a group of pipeline stages: `launcher local --pp-size 2` with the model's layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.service.checks import cache_round_trip
from tests.service.harness import running_service, wait_for
from tpcache.io.storage import StorageKey
from tpcache.testing.waits import prefetched

pytestmark = pytest.mark.multiprocess


def test_two_stages_each_hold_their_layers_and_store_under_their_stage(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    args = ("--pp-size", "2", "--page-size", "4", "--device-pages", "16", "--host-pages", "16")
    args += ("--model-layout", "L4xH2xD4:fp32", "--storage-dir", str(storage), "--heartbeat-s", "0.2")
    with running_service(tmp_path, *args, nproc=2) as service:
        cache_round_trip(service)  # equal digests on both stages
        log = service.log()
        for rank, layers in ((0, "0-1"), (1, "2-3")):
            assert f"group: PP2xTP1 rank {rank}: stage {rank} of 2 (layers {layers} of 4), tensor rank 0 of 1" in log
        assert log.count("memory: L2xH2xD4:fp32, 512 B a page") == 2  # each stage holds half of a 1 KiB page

        def stored(rank: int) -> set[StorageKey]:
            owner = storage / f"rank{rank}" / f"p{rank}of2.r0of1"
            found = [re.findall(rb"v1/[!-~]+?/[0-9a-f]{16}", seg.read_bytes()) for seg in owner.glob("*.seg")]
            return {StorageKey.decode(k.decode()) for keys in found for k in keys}

        assert wait_for(lambda: all(len(stored(r)) == 3 for r in (0, 1)), 30), log
        for rank in (0, 1):
            assert {(k.pp_rank, k.pp_size, k.tp_rank, k.tp_size) for k in stored(rank)} == {(rank, 2, 0, 1)}


def test_a_tp2_service_stores_model_shards_that_a_tp1_group_reads(tmp_path: Path) -> None:
    from tests.storage.test_storage_sharded import MODEL_ID, on_group, tokens
    from tpcache.comm.parallel import ParallelGroup

    storage = tmp_path / "kv"
    args = ("--page-size", "4", "--device-pages", "16", "--host-pages", "16", "--heartbeat-s", "0.2")
    args += ("--model-layout", "L4xH4xD8:fp16", "--model-id", MODEL_ID, "--storage-dir", str(storage))
    toks = tokens(1, 2, 3)
    with running_service(tmp_path, *args, nproc=2) as service:
        with service.client() as c:
            lk = c.lock(toks)
            ins = c.insert(toks, list(c.alloc(lk.lease, 3).device_page_ids), lease=lk.lease)
            assert ins.inserted_pages == 3
            c.release(lk.lease)

        def stored(owner: str) -> set[StorageKey]:
            found = [
                re.findall(rb"v2/[!-~]+?/[0-9a-f]{16}", s.read_bytes())
                for s in (storage / "model" / owner).glob("*.seg")
            ]
            return {StorageKey.decode(k.decode()) for keys in found for k in keys}

        # Each rank writes its two KV heads of every layer of each page, one shard a head and layer.
        assert wait_for(lambda: all(len(stored(f"r{r}of2")) == 3 * 2 * 4 for r in (0, 1)), 30), service.log()
        assert {k.heads for k in stored("r1of2")} == {(2, 2), (3, 3)}
        assert "storage layout: shared by every group shape of model 'tiny-4h'" in service.log()

    def lookup(tp):  # noqa: ANN001, ANN202
        lease, _ = tp.lock(toks)
        assert tp.prefetch(lease)
        status = prefetched(tp, lease)
        tp.release(lease)
        tp.drain()
        return status, tp.storage.stats()["page_hits"]

    assert on_group(ParallelGroup(tp_size=1), f"file://{storage}", lookup) == [(("done", 3), 3)]
