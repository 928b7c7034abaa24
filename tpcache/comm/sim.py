"""An in-process simulated group of N ranks, for the simulation test ring.

Two ways to drive it:

- split-phase, single-threaded and deterministic: the simulator gathers every rank's vector and calls
  ``group.reduce(vectors)``; a rank that did not submit (``None``) or was ``kill``-ed makes the round
  raise ``CollectiveTimeout`` naming it, exactly what the survivors of a real group would see.
- threaded: ``group.collective(rank)`` is a ``Collective`` whose ``allreduce_min`` blocks until every
  rank of the group has submitted its vector for that round (ranks run as threads).

Semantics shared with the real transports: a failed round (missing rank, cross-rank length mismatch)
breaks the group; later rounds raise ``CollectiveClosed`` until ``restart()``, which models the launcher
restarting the whole group. ``calls[rank]`` counts each rank's submitted rounds.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Sequence

from tpcache.comm.collective import (
    Collective,
    CollectiveClosed,
    CollectiveError,
    CollectiveTimeout,
    elementwise_min,
    to_int64_array,
)


def _copy_error(exc: CollectiveError) -> CollectiveError:
    """A fresh exception equal to ``exc``, so each waiting thread raises its own object."""
    if isinstance(exc, CollectiveTimeout):
        return CollectiveTimeout(str(exc), exc.missing_ranks)
    return type(exc)(str(exc))


def _missing_message(missing: Sequence[int], killed: set[int]) -> str:
    parts = [f"rank {r} ({'killed' if r in killed else 'did not arrive'})" for r in missing]
    return "round did not complete, missing: " + ", ".join(parts)


class SimGroup:
    """N simulated ranks sharing one MIN all-reduce. Not thread-safe in split-phase use."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.calls: list[int] = [0] * world_size
        self.rounds = 0  # completed rounds
        self._killed: set[int] = set()
        self._broken: str | None = None
        self._failure: CollectiveError | None = None  # the error that broke the group, re-raised to waiters
        self._cv = threading.Condition()
        self._handles: dict[int, SimCollective] = {}
        # threaded mode: per round number, each rank's submitted vector (None until it arrives)
        self._inputs: dict[int, list[array | None]] = {}
        self._results: dict[int, list[int]] = {}
        self._taken: dict[int, int] = {}
        self._next_round = [0] * world_size

    # -- fault injection -----------------------------------------------------------------------------

    def kill(self, rank: int) -> None:
        """Make ``rank`` stop taking part: rounds that need it fail with ``CollectiveTimeout``."""
        self._check_rank(rank)
        with self._cv:
            self._killed.add(rank)
            self._cv.notify_all()

    @property
    def killed(self) -> frozenset[int]:
        return frozenset(self._killed)

    @property
    def broken(self) -> str | None:
        """Why the group is broken, or None while it works."""
        return self._broken

    def restart(self) -> None:
        """Model the launcher restarting the group: all ranks alive, not broken, round numbers reset.

        Handles from ``collective()`` are invalidated (they stay closed); ask for new ones.
        """
        with self._cv:
            for handle in self._handles.values():
                handle._break("group restarted")
            self._handles.clear()
            self._killed.clear()
            self._broken = None
            self._failure = None
            self._inputs.clear()
            self._results.clear()
            self._taken.clear()
            self._next_round = [0] * self.world_size
            self._cv.notify_all()

    # -- split-phase ---------------------------------------------------------------------------------

    def reduce(self, vectors: Sequence[Sequence[int] | None]) -> array:
        """One round given every rank's vector (index = rank; ``None`` = that rank did not submit).

        Raises ``ValueError`` for malformed input (nothing counted), ``CollectiveTimeout`` naming ranks
        that did not submit or were killed, ``CollectiveError`` on a cross-rank length mismatch, and
        ``CollectiveClosed`` once broken.
        """
        if len(vectors) != self.world_size:
            raise ValueError(f"reduce needs one entry per rank ({self.world_size}), got {len(vectors)}")
        if self._broken is not None:
            raise CollectiveClosed(f"simulated group is broken ({self._broken}); restart() it")
        arrays = [None if v is None else to_int64_array(v) for v in vectors]
        with self._cv:
            for rank, values in enumerate(arrays):
                if values is not None and rank not in self._killed:
                    self.calls[rank] += 1
            missing = [r for r, v in enumerate(arrays) if v is None or r in self._killed]
            if missing:
                raise self._fail(CollectiveTimeout(_missing_message(missing, self._killed), missing))
            return self._finish([v for v in arrays if v is not None])

    # -- threaded ------------------------------------------------------------------------------------

    def collective(self, rank: int, *, allow_any_thread: bool = True) -> SimCollective:
        """The ``Collective`` handle of ``rank`` (one per rank; the same object on repeated calls)."""
        self._check_rank(rank)
        with self._cv:
            handle = self._handles.get(rank)
            if handle is None:
                handle = SimCollective(self, rank, allow_any_thread=allow_any_thread)
                self._handles[rank] = handle
            return handle

    def _submit(self, rank: int, values: array, timeout_s: float) -> array:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if rank in self._killed:
                raise CollectiveClosed(f"simulated rank {rank} was killed")
            if self._broken is not None:
                raise CollectiveClosed(f"simulated group is broken ({self._broken})")
            rnd = self._next_round[rank]
            self._next_round[rank] += 1
            inputs = self._inputs.setdefault(rnd, [None] * self.world_size)
            inputs[rank] = values
            self.calls[rank] += 1
            if all(v is not None for v in inputs):
                del self._inputs[rnd]
                self._results[rnd] = self._finish([v for v in inputs if v is not None])
                self._cv.notify_all()
            while rnd not in self._results:
                if self._failure is not None:
                    raise _copy_error(self._failure)
                missing = self._missing(rnd)
                remaining = deadline - time.monotonic()
                if self._killed.intersection(missing) or remaining <= 0:
                    raise self._fail(CollectiveTimeout(_missing_message(missing, self._killed), missing))
                self._cv.wait(remaining)
            result = self._results[rnd]
            self._taken[rnd] = self._taken.get(rnd, 0) + 1
            if self._taken[rnd] == self.world_size:  # everyone has it: forget the round
                del self._results[rnd], self._taken[rnd]
            return array("q", result)  # its own copy

    # -- shared --------------------------------------------------------------------------------------

    def _missing(self, rnd: int) -> list[int]:
        inputs = self._inputs[rnd]
        return [r for r, v in enumerate(inputs) if v is None]

    def _fail(self, exc: CollectiveError) -> CollectiveError:
        """Break the group with ``exc`` (wakes threaded waiters, who re-raise a copy); returns it."""
        self._broken = str(exc)
        self._failure = exc
        self._cv.notify_all()
        return exc

    def _finish(self, arrays: list[array]) -> array:
        lengths = {len(v) for v in arrays}
        if len(lengths) != 1:
            per_rank = ", ".join(f"rank {r}: {len(v)}" for r, v in enumerate(arrays))
            raise self._fail(CollectiveError(f"round vector length differs across ranks ({per_rank})"))
        self.rounds += 1
        return elementwise_min(arrays)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a group of size {self.world_size}")


class SimCollective(Collective):
    """One simulated rank's ``Collective``; ranks are threads of this process."""

    def __init__(self, group: SimGroup, rank: int, *, allow_any_thread: bool = True) -> None:
        super().__init__(rank, group.world_size, "sim", allow_any_thread=allow_any_thread)
        self.group = group

    def _allreduce_min(self, values: array, timeout_s: float) -> array:
        return self.group._submit(self.rank, values, timeout_s)
