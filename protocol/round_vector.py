"""The round vector: every rank's local facts, agreed by one elementwise MIN all-reduce.

Each field ``x`` travels as the pair ``(x, -x)``: after MIN over ranks the pair holds
``(min, -max)``, so one collective gives both the minimum and the maximum of every field, and a
field is *agreed* exactly when ``min == max``. The layout is fixed per configuration (same field
list on every rank, checked through ``LAYOUT_VERSION`` and the layout digest field), so the
collective always has one shape. Values must lie in ``[-(2**63 - 1), 2**63 - 1]``.

Field order (version 3)::

    header:   layout, round, seq, state_digest, health, drained, idle, flush, leases
              (drained: no copy physically in flight on the rank; idle: drained and no op in flight
              in its core, so a loop that waits for quiet ends in the same round on every rank;
              leases: digest of the leases a flush keeps, which must agree for the flush to run)
    per queue q in QUEUES:
              q.queue_digest   digest of the ids of every op in flight on q (must agree)
              q.done           ops finished at the head of q, in issue order
              q.clean          ops at the head of q that succeeded on every page
              q.head_acked     leading pages acked by the head op (partial success)
    ids:      next_op, next_lease   (a flush continues both from their maximum over ranks)
    quantities: host_deficit
    storage:  storage_down   1 when the rank's storage tier can no longer be used (its directory was
              removed or made read-only): the maximum turns storage off on every rank, agreed,
              without closing the cache
    plan:     plan_count, plan_tokens, plan_digest   (the plan prepared last round)
    per component of a hybrid model, in component order (absent otherwise):
              host_deficit.<name>   that component's pages waiting for a host slot
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import neg
from typing import NamedTuple

LAYOUT_VERSION = 3
INT64_MAX = (1 << 63) - 1
QUEUES = ("backup", "load", "storage_write", "storage_read", "storage_query")
HEADER = ("layout", "round", "seq", "state_digest", "health", "drained", "idle", "flush", "leases")
QUEUE_FIELDS = ("queue_digest", "done", "clean", "head_acked")
TAIL = ("next_op", "next_lease", "host_deficit", "storage_down", "plan_count", "plan_tokens", "plan_digest")

# Health bits a rank sets about itself; any bit but HEALTH_STORAGE_DOWN on any rank closes the cache.
HEALTH_IO_ERROR = 1 << 0  # its I/O layer was handed a copy it refuses: its state cannot be trusted
HEALTH_PREPARE_FAILED = 1 << 1  # it could not prepare its vector (sent in its place)
HEALTH_COMMIT_FAILED = 1 << 2  # its last commit raised midway
# Not a closing bit: the round sends it as its own field (``storage_down``), so one rank's unusable
# storage turns storage off on every rank while the cache stays open.
HEALTH_STORAGE_DOWN = 1 << 3  # its storage tier can no longer be used


class RoundVectorError(ValueError):
    pass


@dataclass(frozen=True)
class RoundLayout:
    fields: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.fields)) != len(self.fields):
            raise RoundVectorError("round layout has a field twice")
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(self.fields)})

    @classmethod
    def default(cls, queues: Sequence[str] = QUEUES, components: Sequence[str] = ()) -> RoundLayout:
        per_queue = tuple(f"{q}.{f}" for q in queues for f in QUEUE_FIELDS)
        return cls(HEADER + per_queue + TAIL + tuple(f"host_deficit.{c}" for c in components))

    @property
    def length(self) -> int:
        """Number of int64 elements on the wire (two per field)."""
        return 2 * len(self.fields)

    def index(self, name: str) -> int:
        try:
            return self._index[name]  # type: ignore[attr-defined]
        except KeyError:
            raise RoundVectorError(f"no field {name!r} in the round layout") from None

    def pack_values(self, values: Sequence[int]) -> list[int]:
        """``[x0, -x0, x1, -x1, ...]`` from the values in layout order."""
        if len(values) != len(self.fields):
            raise RoundVectorError(f"round vector needs {len(self.fields)} values, got {len(values)}")
        if values and (max(values) > INT64_MAX or min(values) < -INT64_MAX):
            bad = next(i for i, x in enumerate(values) if not -INT64_MAX <= x <= INT64_MAX)
            raise RoundVectorError(f"field {self.fields[bad]} = {values[bad]} does not fit the round vector's int64")
        out = [0] * (2 * len(values))
        out[0::2] = values
        out[1::2] = map(neg, values)
        return out

    def unpack(self, reduced: Sequence[int]) -> Agreement:
        if len(reduced) != self.length:
            raise RoundVectorError(f"round vector has {len(reduced)} elements, layout needs {self.length}")
        index = self._index  # type: ignore[attr-defined]
        return Agreement(_Fields(index, list(reduced[0::2])), _Fields(index, list(map(neg, reduced[1::2]))))

    def unanimous(self, values: Sequence[int]) -> Agreement:
        """The agreement when every rank sent ``values`` (the reduced vector equals its own
        ``pack_values(values)``): each field's minimum and maximum are its value here."""
        fields = _Fields(self._index, values)  # type: ignore[attr-defined]
        return Agreement(fields, fields)


class _Fields:
    """Per-field values, read by name (or by position in ``values``, in layout order)."""

    __slots__ = ("_index", "values")

    def __init__(self, index: dict[str, int], values: list[int]) -> None:
        self._index = index
        self.values = values

    def __getitem__(self, name: str) -> int:
        return self.values[self._index[name]]


class Agreement(NamedTuple):
    """Per field, the minimum (``lo``) and maximum (``hi``) over all ranks (a tuple: every round
    makes one, and a frozen dataclass costs several times as much to build)."""

    lo: _Fields
    hi: _Fields

    @property
    def unanimous(self) -> bool:
        """Every field agreed (the common case: one list comparison)."""
        return self.lo is self.hi or self.lo.values == self.hi.values

    def agreed(self, name: str) -> bool:
        return self.lo[name] == self.hi[name]

    def disagreeing(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if self.lo[n] != self.hi[n]]
