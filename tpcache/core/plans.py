"""Plans: mutations that depend on agreed inputs, run two-phase across rounds.

Round r prepares a plan from agreed data; round r+1 checks its ``(count, tokens, digest)`` on every
rank and executes it only where all agree. Execution re-checks each item, so a plan that went stale
between the rounds does nothing wrong, only less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from protocol.round_vector import Agreement


@dataclass
class Plan:
    feature: str
    node_ids: list[int]
    tokens: int
    digest: int
    parts: list[int] = field(default_factory=list)  # per node, the component it concerns (empty: full pages)

    @property
    def count(self) -> int:
        return len(self.node_ids)


class PlanFeature(Protocol):
    name: str

    def prepare(self, agreement: Agreement) -> Plan | None: ...

    def execute(self, plan: Plan) -> int: ...
