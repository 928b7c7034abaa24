"""The connector's worker side on two simulated ranks (no vLLM engine): the step's operations, one
round per step, and what each rank reports; a divergence closes, flushes and reopens both."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.engine.test_external_pages import block, engine_kv, make, run_ranks, same, toks
from tpcache.integrations.vllm.faults import FaultPlan
from tpcache.integrations.vllm.messages import ANSWER, LOAD, LOOKUP, RELEASE, SAVE, StepOps
from tpcache.integrations.vllm.worker import WorkerSide
from tpcache.io.storage import MemoryBackend
from tpcache.testing.waits import HANG_GUARD_S, landed

PAGE = 16


def run_steps(
    schedule: dict[int, list[tuple]], steps: int, arm: dict[int, dict] | None = None, layered: bool = False
) -> list[Any]:
    """Each rank's reports per step. ``layered``: copies by layer, driven as vLLM's hooks drive them
    (the operations applied, then per layer: wait for its loads, hand it over for its saves)."""

    def body(rank: int, collective: Any) -> list[dict[str, Any]]:
        faults = FaultPlan({}, rank)
        hooks = {"before_copy": faults.before_copy, "after_copy": faults.after_copy, "hold": faults.hold}
        kv = engine_kv(rank)
        cache = make(kv, collective, layered=layered, layer_delay=faults.layer_delay, **hooks)
        faults.transfer = cache.transfer
        worker = WorkerSide(cache, faults=faults)
        out = []
        for step in range(steps):
            if arm and step in arm:
                faults.arm(arm[step])
            meta = StepOps(step, schedule.get(step, []))
            before_forward: dict[str, Any] = {}
            if not layered:  # as the connector's start_load_kv: the sync loads leading the step first
                worker.begin_step(meta, sync_loads_only=True)
                before_forward = {"requests": sorted(worker.requests), "7=1": same(block(kv, 7), block(kv, 1))}
            if layered:
                worker.begin_step(meta)
                for layer in range(cache.engine_kv.num_layers):
                    worker.wait_layer(layer)
                    worker.layer_computed(layer)
                result = worker.end_step()
            else:
                result = worker.run_step(meta)
            out.append(
                {
                    "hits": dict(result.report.hits),
                    "step": result.report.step,
                    "sent": sorted(result.finished_sending),
                    "recv": sorted(result.finished_recving),
                    "invalid": sorted(result.invalid_blocks),
                    "sync": dict(result.report.sync_loads),
                    "before_forward": before_forward,
                    "closed": worker.cache.core.closed,
                    "digest": worker.cache.core.digest.value,
                    "leases": len(worker.cache.core.leases),
                    "copies": dict(cache.transfer.counters),
                }
            )
        return out

    results = run_ranks(body)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


# A request saves three pages and finishes; a second one hits them and loads them.
SAVE_THEN_LOAD = {
    0: [(LOOKUP, "a", toks(1, 2, 3))],
    1: [(SAVE, "a", [], 3, [[0, 1, 2]])],
    2: [(RELEASE, "a", True)],
    3: [(LOOKUP, "b", toks(1, 2, 3, 4))],
    4: [(LOAD, "b", 1, [[7, 8]])],
    5: [(RELEASE, "b", True)],
}


def test_hits_are_reported_after_the_round_and_loads_land_on_every_rank() -> None:
    ranks = run_steps(SAVE_THEN_LOAD, 7)
    for steps in ranks:
        assert [s["step"] for s in steps] == list(range(7))  # a lookup's seconds start at its step's report
        assert steps[0]["hits"] == {"a": (0, 0)}
        assert steps[2]["sent"] == ["a"]
        assert steps[3]["hits"] == {"b": (3 * PAGE, 0)}
        assert steps[4]["recv"] == ["b"] and steps[4]["invalid"] == []
        assert steps[5]["sent"] == ["b"] and steps[6]["leases"] == 0
    assert [s["digest"] for s in ranks[0]] == [s["digest"] for s in ranks[1]]


def test_copies_by_layer_on_a_slow_rank_report_what_whole_copies_report() -> None:
    whole = run_steps(SAVE_THEN_LOAD, 7)
    layered = run_steps(SAVE_THEN_LOAD, 7, arm={0: {"delay_copies": {"rank": 1, "seconds": 0.01}}}, layered=True)
    for a, b in zip(whole, layered, strict=True):
        assert [{k: v for k, v in s.items() if k not in ("copies", "before_forward")} for s in a] == [
            {k: v for k, v in s.items() if k not in ("copies", "before_forward")} for s in b
        ]
    copies = [r[-1]["copies"] for r in layered]
    assert all(c["save_layers_by_hook"] > 0 and c["check_failures"] == 0 for c in copies), copies
    assert copies[1]["checked_layers"] == copies[1]["layer_copies"] > 0, copies  # the slow rank checked each


def test_a_load_failing_on_one_rank_is_invalid_on_every_rank() -> None:
    schedule = {
        0: [(LOOKUP, "a", toks(1, 2))],
        1: [(SAVE, "a", [], 2, [[0, 1]]), (RELEASE, "a", True)],
        2: [(LOOKUP, "b", toks(1, 2))],
        3: [(LOAD, "b", 0, [[5, 6]])],
    }
    ranks = run_steps(schedule, 5, arm={3: {"fail_loads": {"rank": 1, "count": 1}}})
    assert [r[3]["invalid"] for r in ranks] == [[5, 6], [5, 6]]
    assert [r[3]["recv"] for r in ranks] == [["b"], ["b"]]


def test_a_divergence_closes_both_ranks_and_an_agreed_flush_reopens_them_equal() -> None:
    schedule = {
        0: [(LOOKUP, "a", toks(1, 2))],
        1: [(SAVE, "a", [], 2, [[0, 1]])],
        3: [(LOOKUP, "b", toks(1, 2, 3))],  # looked up while closed: a miss, nothing locked
        6: [(SAVE, "a", [], 2, [[0, 1]]), (RELEASE, "a", True), (RELEASE, "b", True)],
    }
    ranks = run_steps(schedule, 9, arm={2: {"diverge": {"rank": 1, "step": 1}}})
    for steps in ranks:
        assert steps[2]["closed"]  # the extra operation on rank 1 is caught in the same round
        assert not steps[3]["closed"] and steps[3]["hits"] == {"b": (0, 0)}
        assert not any(s["closed"] for s in steps[3:])
        assert steps[6]["sent"] == ["a", "b"] and steps[8]["leases"] == 0
    assert [s["digest"] for s in ranks[0][3:]] == [s["digest"] for s in ranks[1][3:]]


# The load of SAVE_THEN_LOAD made sync, leading a step that also looks "c" up.
SYNC_LOAD = {
    **SAVE_THEN_LOAD,
    4: [(LOAD, "b", 1, [[7, 8]], True), (LOOKUP, "c", toks(9))],
    5: [(RELEASE, "b", True), (RELEASE, "c", False)],
}


def test_a_sync_load_lands_before_the_rest_of_its_step_and_is_reported_in_the_same_step() -> None:
    for steps in run_steps(SYNC_LOAD, 7):
        # copied in start_load_kv (before vLLM's forward pass), before the step's other operations
        assert steps[4]["before_forward"] == {"requests": ["b"], "7=1": True}
        assert steps[4]["sync"] == {"b": True} and steps[4]["invalid"] == []
        assert steps[4]["recv"] == []  # vLLM scheduled the request: it waits for no finished load
        assert steps[5]["sent"] == ["b"] and steps[6]["leases"] == 0
        assert steps[3]["before_forward"]["7=1"] is False  # the blocks differed before the load


def test_a_sync_load_failing_on_one_rank_is_invalid_on_every_rank_in_its_own_step() -> None:
    ranks = run_steps(SYNC_LOAD, 7, arm={4: {"fail_loads": {"rank": 1, "count": 1}}})
    assert [r[4]["before_forward"]["7=1"] for r in ranks] == [True, False]
    assert [(r[4]["invalid"], r[4]["sync"], r[4]["recv"]) for r in ranks] == [([7, 8], {"b": False}, [])] * 2
    assert [s["digest"] for s in ranks[0]] == [s["digest"] for s in ranks[1]]


class GatedStorage(MemoryBackend):
    """Storage whose reads wait until the test opens the gate: a prefetch stays in flight for as
    many rounds as the test runs (no timing involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get(self, keys: Any, out: Any) -> list[bool]:
        self.gate.wait(60)
        return super().get(keys, out)


def storage_lookup(steps: list[list[tuple]], stop_when_hit: bool = False) -> list[list[dict[str, Any]]]:
    """Each rank's hits per step of a fresh engine whose storage holds pages 5 and 6 (saved by an
    earlier engine) while its reads wait at the gate; the gate opens after ``steps`` when
    ``stop_when_hit`` (then the ranks step on, bounded, until "b" is reported)."""
    stores = [GatedStorage() for _ in range(2)]
    for store in stores:
        store.gate.set()  # the earlier engine's writes and reads go through

    def write(rank: int, collective: Any) -> None:
        worker = WorkerSide(make(engine_kv(rank), collective, storage=stores[rank]))
        for ops in ([(LOOKUP, "a", toks(5, 6))], [(SAVE, "a", [], 2, [[0, 1]])], [(RELEASE, "a", True)]):
            worker.run_step(StepOps(0, ops))
        worker.cache.drain(pause_s=0)
        assert worker.cache.stats()["storage_written_pages"] == 2

    def read(rank: int, collective: Any) -> list[dict[str, Any]]:
        worker = WorkerSide(make(engine_kv(rank + 2), collective, storage=stores[rank]))
        out = [dict(worker.run_step(StepOps(i, ops)).report.hits) for i, ops in enumerate(steps)]
        if stop_when_hit:
            stores[rank].gate.set()
            deadline = time.monotonic() + HANG_GUARD_S
            while True:  # rounds until the read landed on every rank
                out.append(dict(worker.run_step(StepOps(len(out), [])).report.hits))
                if out[-1]:
                    break
                assert time.monotonic() < deadline, "the storage read never landed"
                landed(worker.cache, deadline)
        stores[rank].gate.set()
        return out

    for result in run_ranks(write):
        assert result is None, result
    for store in stores:
        store.gate.clear()
    results = run_ranks(read)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def test_a_lookup_waits_for_its_prefetch_until_the_answer_op_and_every_rank_answers_in_its_step() -> None:
    waits = 100  # more rounds than any step count would allow: the seconds decide, by the scheduler
    steps = [[(LOOKUP, "b", toks(5, 6, 7))]] + [[] for _ in range(waits)] + [[(ANSWER, "b")], []]
    for hits in storage_lookup(steps):
        assert hits[: waits + 1] == [{}] * (waits + 1)  # still waiting: the reads have not landed
        assert hits[waits + 1] == {"b": (0, 0)}  # answered in the step of the op, with what landed: none
        assert hits[waits + 2] == {}  # once


def test_without_an_answer_op_a_lookup_waits_any_number_of_rounds_for_its_prefetch() -> None:
    waits = 100
    ranks = storage_lookup([[(LOOKUP, "b", toks(5, 6, 7))]] + [[] for _ in range(waits)], stop_when_hit=True)
    for hits in ranks:
        assert hits[: waits + 1] == [{}] * (waits + 1)
        assert hits[-1] == {"b": (2 * PAGE, 2 * PAGE)}  # both pages read from storage
    assert len(ranks[0]) == len(ranks[1])  # reported in the same round on both
