"""Plans: mutations that depend on agreed inputs, run two-phase across rounds.

Round r prepares a plan from agreed data; round r+1 checks its ``(count, tokens, digest)`` on
every rank and executes it only where all agree. Execution re-checks each item, so a plan that
went stale between the rounds does nothing wrong, only less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tpcache.core.digest import mix_ids

if TYPE_CHECKING:
    from protocol.round_vector import Agreement
    from tpcache.core.cache import CacheCore


@dataclass
class Plan:
    feature: str
    node_ids: list[int]
    tokens: int
    digest: int

    @property
    def count(self) -> int:
        return len(self.node_ids)


class PlanFeature(Protocol):
    name: str

    def prepare(self, core: CacheCore, agreement: Agreement) -> Plan | None: ...

    def execute(self, core: CacheCore, plan: Plan) -> int: ...


class MirrorRelease:
    """Release redundant host mirrors under host pressure (reference seed 002).

    A host copy of a page that is also on device and durable in storage is redundant. When the
    ranks agree the host pool fell short (``host_deficit``, the minimum over ranks), release up to
    that many mirrors, least valuable first, so backups and storage write-out can proceed.
    """

    name = "mirror_release"

    def prepare(self, core: CacheCore, agreement: Agreement) -> Plan | None:
        want = agreement.lo["host_deficit"]
        if want <= 0 or not core.mirrors:
            return None
        # the mirror index holds every page that could qualify; the sort makes its order irrelevant
        candidates = [n for n in core.mirrors.values() if core.is_releasable_mirror(n)]
        candidates.sort(key=core.policy.key)
        chosen = candidates[:want]
        if not chosen:
            return None
        ids = [n.node_id for n in chosen]
        hashes = [n.hash & ((1 << 63) - 1) for n in chosen]
        return Plan(self.name, ids, len(ids) * core.page_size, mix_ids(ids + hashes))

    def execute(self, core: CacheCore, plan: Plan) -> int:
        released = 0
        for node_id in plan.node_ids:
            node = core.tree.nodes.get(node_id)
            if node is not None and core.release_mirror(node):
                released += 1
        return released
