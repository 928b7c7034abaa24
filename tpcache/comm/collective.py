"""The round's collective: one elementwise MIN all-reduce of int64 values per call.

Invariants every implementation keeps:

- ``allreduce_min`` is called from the main thread only (the design forbids collectives from worker
  threads, where they interleave nondeterministically with the main thread's); an implementation may
  be built with ``allow_any_thread=True`` only where ranks are simulated as threads of one process.
- Input is validated before any communication: a vector that is too long for the transport, or holds
  values that are not ints in the int64 range, raises ``ValueError`` and the collective stays usable.
- After a timeout, a lost peer or a cross-rank mismatch the collective is *broken*: every later call
  raises ``CollectiveClosed``. The caller fails the cache closed; the launcher restarts the group.
- ``calls`` counts every ``allreduce_min`` call that passed validation, so tests can assert exactly
  one collective per round.
"""

from __future__ import annotations

import abc
import threading
from array import array
from collections.abc import Sequence

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
DEFAULT_CAPACITY = 256  # most int64 values one round may carry; the round vector is far smaller


class CollectiveError(RuntimeError):
    """The collective failed; the group can no longer be trusted to agree."""


class CollectiveTimeout(CollectiveError):
    """Some ranks did not take part in a round within the timeout (or are known to be gone).

    ``missing_ranks`` lists the ranks that did not arrive; it is empty when the transport cannot tell
    (torch.distributed does not report which peer is missing), and the message says so.
    """

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing_ranks: list[int] = sorted(missing_ranks)


class WrongThreadError(RuntimeError):
    """A collective was issued from a thread other than the main thread (a programming error)."""


class CollectiveClosed(CollectiveError):
    """The collective was closed, or broken by an earlier failure; no further rounds are possible."""


def to_int64_array(vector: Sequence[int]) -> array:
    """Return ``vector`` as an ``array('q')``; ``ValueError`` if an element is not an int64 integer.

    Floats are rejected rather than truncated: a fractional count would silently change agreement.
    """
    if isinstance(vector, array) and vector.typecode == "q":
        return vector
    try:
        return array("q", vector)
    except OverflowError as exc:
        raise ValueError(f"round vector has a value outside the int64 range: {exc}") from None
    except TypeError as exc:
        raise ValueError(f"round vector must hold only ints (int64): {exc}") from None


def elementwise_min(vectors: Sequence[array]) -> array:
    """Elementwise MIN of equally long int64 arrays (the reduction every transport computes), as a
    new array('q').

    Pairwise, skipping vectors equal to the running result: ranks usually agree on most rounds, and
    comparing two arrays (one memory compare) is far cheaper than a Python-level MIN per element.
    """
    result = array("q", vectors[0])
    for vector in vectors[1:]:
        if vector != result:
            result = array("q", map(min, result, vector))
    return result


class Collective(abc.ABC):
    """One rank's handle on the round's MIN all-reduce (see module docstring for invariants)."""

    rank: int
    world_size: int
    name: str
    calls: int
    capacity: int | None  # most values one call may carry; None = unbounded

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: str,
        *,
        capacity: int | None = None,
        allow_any_thread: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.calls = 0
        self.capacity = capacity
        self._allow_any_thread = allow_any_thread
        self._broken: str | None = None  # why the collective can no longer be used, if it cannot

    @property
    def closed(self) -> bool:
        """True once closed or broken; every further ``allreduce_min`` raises ``CollectiveClosed``."""
        return self._broken is not None

    def allreduce_min(self, vector: Sequence[int], timeout_s: float) -> array:
        """Elementwise MIN over all ranks of ``vector`` (same length on every rank), within ``timeout_s``,
        as a new array('q'): the type the round packs its own vector in, so it compares the two directly.

        Raises ``ValueError`` on bad local input (nothing is sent), ``CollectiveTimeout`` when ranks do
        not arrive in time, ``CollectiveError`` on a cross-rank mismatch, ``CollectiveClosed`` when the
        collective is already closed or broken.
        """
        self._check_usable()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        values = to_int64_array(vector)
        self._check_length(len(values))
        self.calls += 1
        try:
            return self._allreduce_min(values, float(timeout_s))
        except CollectiveError as exc:
            self._break(f"{type(exc).__name__}: {exc}")
            raise

    def close(self) -> None:
        """Release the transport's resources; idempotent. Later calls raise ``CollectiveClosed``."""
        if self._broken is None:
            self._broken = "closed"
        self._close()

    # -- for implementations -------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CollectiveClosed(
                f"{self.name} collective on rank {self.rank} is not usable ({self._broken}); "
                "the group must be restarted"
            )
        if not self._allow_any_thread and threading.current_thread() is not threading.main_thread():
            raise WrongThreadError(
                f"allreduce_min called from thread {threading.current_thread().name!r}: the round's "
                "collective must be issued from the main thread only"
            )

    def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why

    def _check_length(self, n: int) -> None:
        """Raise ``ValueError`` when ``n`` values cannot be sent by this transport."""
        if self.capacity is not None and n > self.capacity:
            raise ValueError(
                f"round vector has {n} values but the {self.name} collective was set up for at most "
                f"{self.capacity}; raise its capacity"
            )

    @abc.abstractmethod
    def _allreduce_min(self, values: array, timeout_s: float) -> array:
        """Do one round; raise a ``CollectiveError`` subclass on failure."""

    def _close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release transport resources (called on every ``close``; must be idempotent)."""

    def __enter__(self) -> Collective:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._broken is None else self._broken
        where = f"rank={self.rank}/{self.world_size}"
        return f"<{type(self).__name__} {self.name} {where} calls={self.calls} {state}>"
