"""A request vLLM preempts is looked up again before vLLM allocates for it, and what it had saved
is loaded back (the scheduler side and vLLM's stats objects, without an engine)."""

from __future__ import annotations

import pytest

from tests.unit.test_vllm_connector_parts import B, Manager, Req, output
from tpcache.integrations.vllm.messages import LOAD, LOOKUP, SAVE, WorkerReport
from tpcache.integrations.vllm.scheduler import SchedulerSide


def test_a_preempted_request_is_looked_up_again_and_loads_back_what_it_saved() -> None:
    r = Req("a", list(range(9)), blocks=[1, 2, 3])
    r.num_preemptions = 0
    side = SchedulerSide(B, Manager(r))
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)  # nothing cached at first
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    side.build_meta(output())
    assert side.build_meta(output(a=9)).ops == [(SAVE, "a", [], 2, [[1, 2]])]
    r.num_computed_tokens = 9
    r.all_token_ids += [50, 51, 52, 53]
    assert side.build_meta(output(a=4)).ops == [(SAVE, "a", [50, 51, 52], 3, [[1, 2, 3]])]
    # vLLM preempts it: its blocks are gone, it waits again with 13 tokens of which 12 were computed
    r.num_computed_tokens, r.num_preemptions, r.blocks = 0, 1, [7, 8, 9, 10]
    assert side.num_new_matched_tokens(r, 0) == (None, False)  # the hit of 0 is stale: asked again
    assert side.build_meta(output()).ops == [(LOOKUP, "a", list(range(9)) + [50, 51, 52, 53])]
    side.update_from_output(WorkerReport(hits={"a": (12, 0)}), None)
    assert side.num_new_matched_tokens(r, 0) == (12, True)
    side.update_state_after_alloc(r, (r.blocks,), 12)
    assert side.build_meta(output()).ops == [(LOAD, "a", 0, [[7, 8, 9]])]
    side.update_from_output(WorkerReport(), {"a"})
    r.num_computed_tokens = 12
    side.build_meta(output(a=1))  # 13 were computed before: only the partial page's token again
    c = side.counters
    assert c["preemptions"] == 1 and c["preempted_loaded_tokens"] == 12
    assert c["preempted_recomputed_tokens"] == 1 and c["lookups"] == 2 and c["hit_tokens_host"] == 12


def test_without_tpcache_a_preempted_request_counts_what_it_computes_again() -> None:
    r = Req("a", list(range(9)), blocks=[1, 2, 3])
    r.num_preemptions = 0
    side = SchedulerSide(B, Manager(r))
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)
    side.num_new_matched_tokens(r, 0)
    side.build_meta(output(a=9))
    r.num_computed_tokens, r.num_preemptions = 0, 1
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)  # a cache that lost the pages
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    side.build_meta(output(a=9))
    assert side.counters["preempted_recomputed_tokens"] == 9


def test_vllm_stats_sum_increments_and_build_from_vllms_dict() -> None:
    pytest.importorskip("vllm")
    from tpcache.integrations.vllm.stats import Increments, TPCacheStats

    inc = Increments()
    assert inc.take({"loaded_pages": 0}) is None
    first = inc.take({"loaded_pages": 3, "closes": 0})
    assert first is not None and first.data == {"loaded_pages": 3}
    assert inc.take({"loaded_pages": 3}) is None  # nothing moved since
    merged = first.aggregate(TPCacheStats(data={"loaded_pages": 2, "hit_tokens_host": 64}))
    assert merged.data == {"loaded_pages": 5, "hit_tokens_host": 64}
    assert merged.reduce() == {"tpcache_hit_tokens_host": 64, "tpcache_loaded_pages": 5}
    assert TPCacheStats(data={}).is_empty() and not merged.is_empty()


class HashedReq(Req):
    """A request with vLLM's block hashes (each page's hash covers every token before its end)."""

    @property
    def block_hashes(self) -> list[tuple[int, ...]]:
        n = len(self.all_token_ids) // B
        return [tuple(self.all_token_ids[: (i + 1) * B]) for i in range(n)]


def test_a_waiting_request_whose_hit_a_later_save_extended_is_looked_up_again() -> None:
    shared = list(range(100, 108))
    a = HashedReq("a", [*shared, 1, 2], blocks=[1, 2, 3])
    b = HashedReq("b", [*shared, 7, 8, 9], blocks=[4, 5, 6])
    side = SchedulerSide(B, Manager(a, b))
    side.num_new_matched_tokens(a, 0)
    side.num_new_matched_tokens(b, 0)
    assert [op[0] for op in side.build_meta(output()).ops] == [LOOKUP, LOOKUP]
    side.update_from_output(WorkerReport(hits={"a": (0, 0), "b": (0, 0)}), None)  # both miss
    assert side.num_new_matched_tokens(a, 0) == (0, False)  # a runs; b waits for blocks
    assert side.build_meta(output(a=10)).ops == [(SAVE, "a", [], 2, [[1, 2]])]
    # b's hit of 0 is stale: a saved the two pages b starts with after b's lookup
    assert side.num_new_matched_tokens(b, 0) == (None, False)
    assert side.build_meta(output()).ops == [(LOOKUP, "b", b.all_token_ids)]
    side.update_from_output(WorkerReport(hits={"b": (8, 0)}), None)
    assert side.num_new_matched_tokens(b, 0) == (8, True)
    assert side.counters["stale_lookups_refreshed"] == 1 and side.counters["lookups"] == 3


def test_a_request_whose_load_failed_is_not_looked_up_again() -> None:
    shared = list(range(100, 108))
    a = HashedReq("a", [*shared, 1, 2], blocks=[1, 2, 3])
    b = HashedReq("b", [*shared, 7, 8, 9], blocks=[4, 5, 6])
    side = SchedulerSide(B, Manager(a, b))
    side.num_new_matched_tokens(b, 0)
    side.update_from_output(WorkerReport(hits={"b": (8, 0)}), None)
    side.build_meta(output())
    assert side.num_new_matched_tokens(b, 0) == (8, True)
    side.update_state_after_alloc(b, (b.blocks,), 8)
    side.build_meta(output())
    side.update_from_output(WorkerReport(), {"b"}, {5})  # its load failed on some rank
    side.num_new_matched_tokens(a, 0)
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)
    side.num_new_matched_tokens(a, 0)
    side.build_meta(output(a=10))  # a saves the pages b would hit
    assert side.num_new_matched_tokens(b, 0) == (0, False)  # recomputed, not retried
    assert side.counters["stale_lookups_refreshed"] == 0
