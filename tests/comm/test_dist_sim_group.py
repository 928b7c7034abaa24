"""The simulated group: MIN semantics, call counting and fault injection, split-phase and threaded."""

from __future__ import annotations

import random
import threading
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpcache.comm import (
    CollectiveClosed,
    CollectiveError,
    CollectiveTimeout,
    SimGroup,
    WrongThreadError,
)
from tpcache.comm.collective import INT64_MAX, INT64_MIN

int64 = st.integers(min_value=INT64_MIN, max_value=INT64_MAX)


@given(st.integers(1, 8).flatmap(lambda n: st.lists(st.lists(int64, min_size=3, max_size=3), min_size=n, max_size=n)))
def test_reduce_is_elementwise_min(vectors: list[list[int]]) -> None:
    group = SimGroup(len(vectors))
    result = group.reduce(vectors)
    assert result == array("q", [min(column) for column in zip(*vectors, strict=True)])  # the round's type
    assert group.calls == [1] * len(vectors)


def test_calls_and_rounds_are_counted_per_rank() -> None:
    group = SimGroup(3)
    rng = random.Random(7)
    for _ in range(25):
        group.reduce([[rng.randint(-9, 9) for _ in range(4)] for _ in range(3)])
    assert group.calls == [25, 25, 25]
    assert group.rounds == 25


def test_killed_rank_times_out_the_round_and_breaks_the_group() -> None:
    group = SimGroup(4)
    group.reduce([[1], [2], [3], [4]])
    group.kill(2)
    with pytest.raises(CollectiveTimeout, match="rank 2 \\(killed\\)") as info:
        group.reduce([[1], [2], [3], [4]])
    assert info.value.missing_ranks == [2]
    assert group.calls == [2, 2, 1, 2]  # the dead rank took no part
    with pytest.raises(CollectiveClosed):
        group.reduce([[1], [2], [3], [4]])
    group.restart()
    assert group.reduce([[5], [2], [3], [4]]).tolist() == [2]


def test_rank_that_does_not_submit_is_named() -> None:
    group = SimGroup(3)
    with pytest.raises(CollectiveTimeout, match="rank 0 \\(did not arrive\\), rank 2") as info:
        group.reduce([None, [1, 2], None])
    assert info.value.missing_ranks == [0, 2]


def test_length_mismatch_across_ranks_breaks_the_group() -> None:
    group = SimGroup(2)
    with pytest.raises(CollectiveError, match="length differs") as info:
        group.reduce([[1, 2], [1]])
    assert not isinstance(info.value, CollectiveTimeout)
    assert group.broken is not None


@pytest.mark.parametrize("bad", [[INT64_MAX + 1], [INT64_MIN - 1], [0.5], ["3"]])
def test_bad_values_raise_value_error_and_leave_the_group_working(bad: list[object]) -> None:
    group = SimGroup(2)
    with pytest.raises(ValueError):
        group.reduce([[1], bad])  # type: ignore[list-item]
    assert group.calls == [0, 0]
    assert group.reduce([[1], [0]]).tolist() == [0]


def test_reduce_needs_one_entry_per_rank() -> None:
    with pytest.raises(ValueError, match="one entry per rank"):
        SimGroup(3).reduce([[1], [2]])


def run_threads(group: SimGroup, body: dict[int, object]) -> dict[int, object]:
    """Run body[rank](collective) in one thread per rank; return each rank's result or exception."""
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = body[rank](group.collective(rank))  # type: ignore[operator]
        except Exception as exc:  # the test inspects it
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in body]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    return out


@pytest.mark.parametrize("world", [1, 2, 5, 8])
def test_threaded_ranks_agree_on_every_round(world: int) -> None:
    group = SimGroup(world)
    rounds = 40

    def vec(rnd: int, rank: int) -> list[int]:
        rng = random.Random(f"{rnd}:{rank}")
        return [rng.randint(INT64_MIN, INT64_MAX) for _ in range(6)]

    def body(c: object) -> list[list[int]]:
        return [c.allreduce_min(vec(rnd, c.rank), 10.0).tolist() for rnd in range(rounds)]  # type: ignore[attr-defined]

    out = run_threads(group, {r: body for r in range(world)})
    expected = [[min(col) for col in zip(*(vec(rnd, r) for r in range(world)), strict=True)] for rnd in range(rounds)]
    assert all(out[r] == expected for r in range(world))
    assert group.calls == [rounds] * world
    assert all(group.collective(r).calls == rounds for r in range(world))


def test_threaded_missing_rank_times_out_naming_it() -> None:
    group = SimGroup(3)

    def waiter(c: object) -> object:
        try:
            c.allreduce_min([1], 0.3)  # type: ignore[attr-defined]
        except CollectiveTimeout as exc:
            return exc
        return None

    out = run_threads(group, {0: waiter, 1: waiter})  # rank 2 never calls
    for rank in (0, 1):
        exc = out[rank]
        assert isinstance(exc, CollectiveTimeout) and exc.missing_ranks == [2]
    with pytest.raises(CollectiveClosed):
        group.collective(0).allreduce_min([1], 0.3)


def test_threaded_kill_wakes_waiters_at_once() -> None:
    group = SimGroup(3)
    started = threading.Event()

    def waiter(c: object) -> object:
        started.set()
        try:
            # A timeout no test run reaches: only the kill can end this wait (a wake-up that never
            # comes fails the test by pytest-timeout instead of by a clock in the assertion).
            c.allreduce_min([1], 3600.0)  # type: ignore[attr-defined]
        except CollectiveTimeout as exc:
            return exc.missing_ranks
        return None

    killer = threading.Timer(0.05, lambda: (started.wait(), group.kill(1)))
    killer.start()
    out = run_threads(group, {0: waiter, 2: waiter})
    killer.join()
    for rank in (0, 2):
        assert out[rank] == [1]
    with pytest.raises(CollectiveClosed, match="killed"):
        group.collective(1).allreduce_min([1], 1.0)


def test_threaded_length_mismatch_reaches_every_rank() -> None:
    group = SimGroup(2)
    out = run_threads(
        group,
        {
            0: lambda c: c.allreduce_min([1, 2], 5.0),  # type: ignore[attr-defined]
            1: lambda c: c.allreduce_min([1], 5.0),  # type: ignore[attr-defined]
        },
    )
    for rank in (0, 1):
        assert isinstance(out[rank], CollectiveError) and "length differs" in str(out[rank])


def test_main_thread_only_unless_opted_out() -> None:
    strict = SimGroup(1).collective(0, allow_any_thread=False)
    assert strict.allreduce_min([3, -3], 1.0).tolist() == [3, -3]  # main thread: fine
    errors: list[BaseException] = []

    def call() -> None:
        try:
            strict.allreduce_min([1], 1.0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], WrongThreadError)
    assert strict.calls == 1  # the refused call was not counted, and the collective still works
    assert strict.allreduce_min([4], 1.0).tolist() == [4]


def test_local_validation_and_close() -> None:
    c = SimGroup(1).collective(0)
    with pytest.raises(ValueError, match="timeout_s"):
        c.allreduce_min([1], 0)
    with pytest.raises(ValueError, match="int64"):
        c.allreduce_min([2**63], 1.0)
    assert c.calls == 0
    c.close()
    c.close()
    with pytest.raises(CollectiveClosed):
        c.allreduce_min([1], 1.0)
