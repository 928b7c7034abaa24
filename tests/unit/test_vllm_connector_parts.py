"""The connector's scheduler side, options and worker-report merge, without running vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tpcache.integrations.vllm.messages import ANSWER, LOAD, LOOKUP, RELEASE, SAVE, WorkerReport
from tpcache.integrations.vllm.options import ConnectorOptions
from tpcache.integrations.vllm.scheduler import SchedulerSide
from tpcache.service.config import ConfigError

B = 4  # block size


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Manager:
    def __init__(self, *reqs: Req) -> None:
        self.reqs = {r.request_id: r for r in reqs}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.reqs[req_id].blocks,)


def output(**scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled)


def test_the_scheduler_waits_for_the_agreed_hit_and_never_loads_the_last_token() -> None:
    r = Req("a", list(range(13)), blocks=[10, 11, 12, 13])
    side = SchedulerSide(B, Manager(r))
    assert side.num_new_matched_tokens(r, 0) == (None, False)
    assert side.num_new_matched_tokens(r, 0) == (None, False)  # asked again: still unknown
    meta = side.build_meta(output())
    assert meta.ops == [(LOOKUP, "a", list(range(13)))]
    assert side.build_meta(output()).ops == []  # sent once
    side.update_from_output(WorkerReport(hits={"a": (12, 0)}), None)
    assert side.num_new_matched_tokens(r, 4) == (8, True)  # vLLM holds the first block itself
    side.update_state_after_alloc(r, (r.blocks,), 8)
    assert side.build_meta(output()).ops == [(LOAD, "a", 1, [[11, 12]])]
    short = Req("b", list(range(12)))
    side.num_new_matched_tokens(short, 0)
    side.update_from_output(WorkerReport(hits={"b": (12, 0)}), None)
    assert side.num_new_matched_tokens(short, 0) == (8, True)  # all 12 cached, but 11 is computed


def test_saves_name_the_blocks_of_computed_pages_and_finish_waits_for_the_release() -> None:
    r = Req("a", list(range(10)), blocks=[5, 6, 7])
    side = SchedulerSide(B, Manager(r))
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)
    side.build_meta(output())
    meta = side.build_meta(output(a=10))  # the step computes all 10 prompt tokens: 2 full pages
    assert meta.ops == [(SAVE, "a", [], 2, [[5, 6]])]
    r.num_computed_tokens = 10
    r.all_token_ids.extend([99, 98, 97])  # sampled; a token's KV exists once a step computed it
    assert side.build_meta(output(a=1)).ops == []  # 11 computed: the third page is not full yet
    r.num_computed_tokens = 12
    assert side.request_finished(r, ([5, 6, 7],)) is True  # vLLM keeps the blocks until released
    assert side.build_meta(output()).ops == [(SAVE, "a", [99, 98], 3, [[5, 6, 7]]), (RELEASE, "a", True)]


def test_a_request_finished_while_its_load_is_pending_is_freed_by_vllm() -> None:
    r = Req("a", list(range(9)), blocks=[1, 2, 3])
    side = SchedulerSide(B, Manager(r))
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (8, 0)}), None)
    side.num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, (r.blocks,), 8)
    assert side.request_finished(r, (r.blocks,)) is False  # vLLM frees on the load's report
    assert side.build_meta(output()).ops[-1] == (RELEASE, "a", False)
    assert side.request_finished(Req("never", [1]), ([],)) is False


def test_a_failed_load_is_recomputed_not_retried() -> None:
    r = Req("a", list(range(13)), blocks=[1, 2, 3, 4])
    side = SchedulerSide(B, Manager(r))
    side.num_new_matched_tokens(r, 0)
    side.update_from_output(WorkerReport(hits={"a": (12, 0)}), None)
    assert side.num_new_matched_tokens(r, 0) == (12, True)
    side.update_state_after_alloc(r, (r.blocks,), 12)
    side.update_from_output(WorkerReport(), {"a"}, {3})  # block 3 did not land on some rank
    assert side.num_new_matched_tokens(r, 0) == (0, False)


def test_worker_reports_merge_to_the_minimum() -> None:
    a = WorkerReport(hits={"x": (64, 32), "y": (32, 0)})
    b = WorkerReport(hits={"x": (32, 32)}, busy=True)
    merged = a.aggregate(b)
    assert merged.hits == {"x": (32, 32), "y": (0, 0)} and merged.busy  # y missing on one worker: a miss


def test_options_take_the_service_names_and_checks() -> None:
    opts = ConnectorOptions.from_extra_config({})
    assert opts.host_pages == opts.host_bytes == 0 and not opts.storage_dir  # sized from free memory
    assert ConnectorOptions.from_extra_config({"round_timeout_s": 5}).round_timeout_s == 5.0
    for bad, match in [
        ({"host_pagez": 1}, "unknown option"),
        ({"host_pages": "8"}, "must be int"),
        ({"transport": "tcp"}, "transport"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"eviction_policy": "random"}, "eviction"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ConnectorOptions.from_extra_config(bad)


def test_copy_by_layer_is_true_false_or_auto_and_auto_follows_where_the_kv_is() -> None:
    import torch

    from tpcache.integrations.vllm.connector import copies_by_layer

    assert ConnectorOptions.from_extra_config({}).copy_by_layer == "auto"
    for value in (True, False, "auto"):
        assert ConnectorOptions.from_extra_config({"copy_by_layer": value}).copy_by_layer == value
    for bad in ("on", 1, None):
        with pytest.raises(ConfigError, match='copy_by_layer must be true, false or "auto"'):
            ConnectorOptions.from_extra_config({"copy_by_layer": bad})
    cpu = {"layers.0": torch.zeros(2, 4)}
    assert copies_by_layer("auto", cpu) is False  # a copy thread would only compete with the forward's threads
    assert copies_by_layer(True, cpu) is True and copies_by_layer(False, cpu) is False
    if torch.cuda.is_available():
        assert copies_by_layer("auto", {"layers.0": torch.zeros(2, 4, device="cuda")}) is True


def test_load_mode_is_auto_sync_or_async_and_several_kv_cache_groups_load_asynchronously() -> None:
    from tpcache.integrations.vllm.connector import sync_loads

    assert ConnectorOptions.from_extra_config({}).load_mode == "auto"
    for bad in ("eager", True, None):
        with pytest.raises(ConfigError, match='load_mode must be "auto", "sync" or "async"'):
            ConnectorOptions.from_extra_config({"load_mode": bad})
    one, two = [(["l0"], False)], [(["l0"], False), (["l1"], True)]
    assert [sync_loads(m, one) for m in ("auto", "sync", "async")] == [True, True, False]
    assert [sync_loads(m, two) for m in ("auto", "async")] == [False, False]  # vLLM refuses invalid blocks there
    with pytest.raises(ConfigError, match='load_mode "sync" needs one KV cache group, this model has 2'):
        sync_loads("sync", two)


def test_a_sync_load_leads_its_step_and_no_save_names_a_block_it_wrote_until_it_is_reported() -> None:
    r = Req("a", list(range(13)), blocks=[10, 11, 12, 13])
    other = Req("o", list(range(100, 109)), blocks=[20, 21, 22])
    side = SchedulerSide(B, Manager(r, other), sync_loads=True)
    side.num_new_matched_tokens(r, 0)
    side.num_new_matched_tokens(other, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={"a": (12, 0), "o": (0, 0)}), None)
    assert side.num_new_matched_tokens(r, 4) == (8, False)  # vLLM schedules it in this step
    side.request_finished(Req("gone", [1]), ([],))  # an op queued before the load
    side.update_state_after_alloc(r, (r.blocks,), 8)
    r.num_computed_tokens = 12  # vLLM counts the loaded tokens computed; the step computes the 13th
    # the load leads; a's saves wait for its outcome, a request sharing none of its blocks saves
    assert side.build_meta(output(a=1, o=8)).ops == [
        (LOAD, "a", 1, [[11, 12]], True),
        (SAVE, "o", [], 2, [[20, 21]]),
    ]
    other.blocks = [20, 11, 22]  # as if vLLM's prefix cache gave it a block the load wrote
    other.all_token_ids.extend(range(4))
    other.num_computed_tokens = 8
    assert side.build_meta(output(a=1, o=4)).ops == []  # neither saves: the outcome is not reported
    side.update_from_output(WorkerReport(sync_loads={"a": True}), None)
    r.num_computed_tokens, other.num_computed_tokens = 13, 12
    ops = side.build_meta(output(a=1, o=1)).ops
    assert [(op[0], op[1], op[3]) for op in ops] == [(SAVE, "a", 3), (SAVE, "o", 3)]


def _sync_load_allocated(r: Req) -> SchedulerSide:
    """A scheduler side with sync loads whose request ``r`` has a 12-token hit allocated by vLLM."""
    side = SchedulerSide(B, Manager(r), sync_loads=True)
    side.num_new_matched_tokens(r, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={r.request_id: (12, 0)}), None)
    side.update_state_after_alloc(r, (r.blocks,), 12)
    return side


def test_a_failed_sync_load_is_not_offered_again_and_its_pages_are_not_saved_before_it_was_reported() -> None:
    r = Req("a", list(range(13)), blocks=[1, 2, 3, 4])
    side = _sync_load_allocated(r)
    r.num_computed_tokens = 12
    assert side.request_finished(r, (r.blocks,)) is True  # aborted: vLLM keeps the blocks until released
    assert side.build_meta(output()).ops == [(LOAD, "a", 0, [[1, 2, 3]], True), (RELEASE, "a", True)]
    merged = WorkerReport(sync_loads={"a": True}).aggregate(WorkerReport(sync_loads={"a": False}))
    assert merged.sync_loads == {"a": False}  # one rank without the pages fails it on every rank
    r2 = Req("b", list(range(13)), blocks=[5, 6, 7, 8])
    side = _sync_load_allocated(r2)
    side.build_meta(output(b=1))
    side.update_from_output(merged.aggregate(WorkerReport(sync_loads={"b": False})), None, {5, 6, 7})
    assert side.requests["b"].load_failed and not side.unconfirmed
    side.requests["b"].preemptions = 0
    assert side.num_new_matched_tokens(r2, 0) == (0, False)


class Clock:
    """The scheduler's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unanswered_lookup_is_told_to_answer_once_its_seconds_are_up_and_a_new_lookup_waits_afresh() -> None:
    r = Req("a", list(range(9)))
    clock = Clock()
    side = SchedulerSide(B, Manager(r), lookup_timeout_s=2.0, clock=clock)
    side.num_new_matched_tokens(r, 0)
    assert side.build_meta(output()).ops == [(LOOKUP, "a", list(range(9)))]
    clock.now = 150.0  # the step that carried it is slow: its seconds start at its report
    side.update_from_output(WorkerReport(step=0), None)
    for _ in range(1000):  # any number of steps within the deadline: no answer op
        clock.now += 0.001
        assert side.build_meta(output()).ops == []
    clock.now = 151.999
    assert side.build_meta(output()).ops == []
    clock.now = 152.0
    assert side.build_meta(output()).ops == [(ANSWER, "a")]
    clock.now = 160.0
    assert side.build_meta(output()).ops == []  # once a lookup
    r.num_preemptions = 1  # looked up again: a fresh start
    side.update_from_output(WorkerReport(hits={"a": (8, 0)}), None)
    assert side.num_new_matched_tokens(r, 0) == (None, False)
    meta = side.build_meta(output())
    assert meta.ops == [(LOOKUP, "a", list(range(9)))]
    side.update_from_output(WorkerReport(step=meta.step - 1), None)  # an earlier step's round: not received yet
    clock.now = 170.0
    assert side.build_meta(output()).ops == []
    side.update_from_output(WorkerReport(step=meta.step), None)
    clock.now = 171.0
    assert side.build_meta(output()).ops == []
    side.update_from_output(WorkerReport(hits={"a": (8, 0)}), None)  # answered in time: no answer op
    clock.now = 200.0
    assert side.build_meta(output()).ops == []


def test_the_engines_first_forward_pass_does_not_count_against_a_lookup() -> None:
    a, b = Req("a", list(range(9))), Req("b", list(range(13)))
    clock = Clock()
    side = SchedulerSide(B, Manager(a, b), lookup_timeout_s=2.0, clock=clock)
    side.num_new_matched_tokens(a, 0)
    side.num_new_matched_tokens(b, 0)
    side.update_from_output(WorkerReport(step=side.build_meta(output()).step), None)
    side.update_from_output(WorkerReport(hits={"a": (8, 0)}, step=side.build_meta(output()).step), None)
    first = side.build_meta(output(a=1))  # a runs the engine's first forward pass, b still waits
    clock.now = 101.0
    assert side.build_meta(output(a=1)).ops == []
    clock.now = 112.0  # vLLM compiled in that pass: b's seconds start over at its report
    side.update_from_output(WorkerReport(step=first.step), None)
    clock.now = 113.9
    assert side.build_meta(output(a=1)).ops == []
    clock.now = 114.0
    assert side.build_meta(output(a=1)).ops == [(ANSWER, "b")]
    side.update_from_output(WorkerReport(hits={"b": (0, 0)}, step=first.step + 2), None)
    side.num_new_matched_tokens(b, 0)
    b.num_preemptions = 1  # a later forward pass counts: a lookup sent now waits 2 s in all
    side.num_new_matched_tokens(b, 0)
    meta = side.build_meta(output(a=1))
    side.update_from_output(WorkerReport(step=meta.step), None)
    clock.now = 130.0
    assert side.build_meta(output(a=1)).ops == [(ANSWER, "b")]


def test_lookup_timeouts_are_checked() -> None:
    opts = ConnectorOptions.from_extra_config({})
    assert opts.lookup_timeout_s == 2.0 and opts.lookup_timeout_rounds == 0  # seconds decide, no step cap
    assert ConnectorOptions.from_extra_config({"lookup_timeout_s": 1}).lookup_timeout_s == 1.0
    for bad, match in [
        ({"lookup_timeout_s": 0}, "lookup_timeout_s must be > 0"),
        ({"lookup_timeout_s": -1.5}, "lookup_timeout_s must be > 0"),
        ({"lookup_timeout_rounds": -1}, "lookup_timeout_rounds must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ConnectorOptions.from_extra_config(bad)
