"""One storage directory shared by vLLM engines of different TP sizes: what a TP=2 engine stored,
a fresh TP=1 engine reads, and the other way (``scenario.cross_tp_plan``; the store is laid out by
the model, ``tpcache.io.storage.sharded``). Only hits tpcache alone could have served count: vLLM
caches a block as soon as it schedules it, so prompts 2-4 of a batch sharing a prefix may hit
vLLM's own cache; the first prompt of a fresh engine's first batch can only hit tpcache, and its
host tier is empty, so that hit came from storage."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import TP2_GROUP
from tests.vllm.scenario import BLOCK, Results, total

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900), pytest.mark.xdist_group(TP2_GROUP)]


def check_read_from_storage(runs: Results, engine: str, batch: str, tp: int) -> None:
    out = runs[engine][batch]
    assert out["tokens"] == runs["ref"][batch]["tokens"]
    assert out["cached"][0] == 3 * BLOCK, out["cached"]  # the shared prefix's three full pages
    stats = runs[engine]["settled" if batch == "second" else "settled_first"]
    assert len(stats) == tp
    storage = total(stats, "storage_hit_tokens")
    assert storage[0] >= 3 * BLOCK and len(set(storage)) == 1, storage  # agreed: the same on every rank
    assert all(s["storage"]["page_hits"] > 0 and s["storage"]["page_partial"] == 0 for s in stats), stats


def test_a_tp1_engine_reads_what_a_tp2_engine_stored(vllm_cross_tp: Results) -> None:
    runs = vllm_cross_tp
    # the writer computed everything itself (an empty store) and matches plain vLLM at TP=1
    assert runs["tp2_writes"]["first"]["tokens"] == runs["ref"]["first"]["tokens"]
    assert total(runs["tp2_writes"]["settled"], "storage_written_pages")[0] > 0
    check_read_from_storage(runs, "tp1_reads", "first", tp=1)


def test_a_tp2_engine_reads_what_a_tp1_engine_stored(vllm_cross_tp: Results) -> None:
    runs = vllm_cross_tp
    assert runs["tp1_reads"]["second"]["cached"][0] == 0  # a batch no engine had stored before
    check_read_from_storage(runs, "tp2_reads", "second", tp=2)
