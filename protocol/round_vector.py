"""The round vector: every rank's local facts, agreed by one elementwise MIN all-reduce.

Each field ``x`` travels as the pair ``(x, -x)``: after MIN over ranks the pair holds
``(min, -max)``, so one collective gives both the minimum and the maximum of every field, and a
field is *agreed* exactly when ``min == max``. The layout is fixed per configuration (same field
list on every rank, checked through ``LAYOUT_VERSION`` and the layout digest field), so the
collective always has one shape. Values must lie in ``[-(2**63 - 1), 2**63 - 1]``.

Field order (version 1)::

    header:   layout, round, seq, state_digest, health, drained
    per queue q in QUEUES:
              q.queue_digest   digest of the ids of every op in flight on q (must agree)
              q.done           ops finished at the head of q, in issue order
              q.clean          ops at the head of q that succeeded on every page
              q.head_acked     leading pages acked by the head op (partial success)
    quantities: host_deficit
    plan:     plan_count, plan_tokens, plan_digest   (the plan prepared last round)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LAYOUT_VERSION = 1
INT64_MAX = (1 << 63) - 1
QUEUES = ("backup", "load", "storage_write", "storage_read", "storage_query")
HEADER = ("layout", "round", "seq", "state_digest", "health", "drained")
QUEUE_FIELDS = ("queue_digest", "done", "clean", "head_acked")
TAIL = ("host_deficit", "plan_count", "plan_tokens", "plan_digest")

# Health bits a rank sets about itself; any bit on any rank closes the cache.
HEALTH_TRANSFER_ERROR = 1 << 0
HEALTH_STORAGE_ERROR = 1 << 1
HEALTH_CLOSING = 1 << 2  # this rank is shutting down


class RoundVectorError(ValueError):
    pass


@dataclass(frozen=True)
class RoundLayout:
    fields: tuple[str, ...]

    @classmethod
    def default(cls, queues: Sequence[str] = QUEUES) -> RoundLayout:
        per_queue = tuple(f"{q}.{f}" for q in queues for f in QUEUE_FIELDS)
        return cls(HEADER + per_queue + TAIL)

    @property
    def length(self) -> int:
        """Number of int64 elements on the wire (two per field)."""
        return 2 * len(self.fields)

    def index(self, name: str) -> int:
        try:
            return self.fields.index(name)
        except ValueError:
            raise RoundVectorError(f"no field {name!r} in the round layout") from None

    def pack(self, values: Mapping[str, int]) -> list[int]:
        """``[x0, -x0, x1, -x1, ...]`` in layout order. Every field must be given."""
        missing = [f for f in self.fields if f not in values]
        extra = [k for k in values if k not in self.fields]
        if missing or extra:
            raise RoundVectorError(f"round vector fields: missing {missing}, unknown {extra}")
        out: list[int] = []
        for name in self.fields:
            x = int(values[name])
            if not -INT64_MAX <= x <= INT64_MAX:
                raise RoundVectorError(f"field {name} = {x} does not fit the round vector's int64")
            out += (x, -x)
        return out

    def unpack(self, reduced: Sequence[int]) -> Agreement:
        if len(reduced) != self.length:
            raise RoundVectorError(f"round vector has {len(reduced)} elements, layout needs {self.length}")
        lo = {name: int(reduced[2 * i]) for i, name in enumerate(self.fields)}
        hi = {name: -int(reduced[2 * i + 1]) for i, name in enumerate(self.fields)}
        return Agreement(lo, hi)


@dataclass(frozen=True)
class Agreement:
    """Per field, the minimum and maximum over all ranks."""

    lo: dict[str, int]
    hi: dict[str, int]

    def agreed(self, name: str) -> bool:
        return self.lo[name] == self.hi[name]

    def value(self, name: str) -> int | None:
        """The agreed value, or None when ranks disagree."""
        return self.lo[name] if self.lo[name] == self.hi[name] else None

    def disagreeing(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if self.lo[n] != self.hi[n]]


def reduce_min(vectors: Sequence[Sequence[int]]) -> list[int]:
    """Elementwise MIN: what the collective computes (used by the simulator and tests)."""
    if not vectors:
        raise RoundVectorError("no vectors to reduce")
    n = len(vectors[0])
    if any(len(v) != n for v in vectors):
        raise RoundVectorError("round vectors of different lengths")
    return [min(col) for col in zip(*vectors, strict=True)]
