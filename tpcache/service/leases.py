"""Who owns each lease the service handed out, and how many each connection may hold.

Every rank keeps the same book: it changes only as sequenced entries are applied (a lock adds its
lease under the connection the entry names, a release, abort or expiry drops it), so an ownership
check gives the same answer on every rank. A lease named by a connection that does not own it is
reported exactly as a lease that does not exist (NOT_FOUND, nothing changes): another client's
lease ids are neither usable nor detectable.

Connection 0 is the leader itself (the transient lease of a storage lookup).
"""

from __future__ import annotations

import protocol as p

LEADER = 0


def not_found(lease: int) -> p.NotFound:
    return p.NotFound(f"no lease {lease}")


class LeaseBook:
    def __init__(self, max_per_owner: int, max_total: int) -> None:
        self.max_per_owner = max_per_owner
        self.max_total = max_total
        self.owner: dict[int, int] = {}  # lease -> connection
        self.by_owner: dict[int, dict[int, None]] = {}  # connection -> its leases, oldest first

    def admit(self, conn: int) -> None:
        """Raise Overloaded when ``conn`` may not take another lease."""
        if len(self.owner) >= self.max_total:
            raise p.Overloaded(f"the service holds {len(self.owner)} leases, its limit; release some and retry")
        held = len(self.by_owner.get(conn, ()))
        if held >= self.max_per_owner and conn != LEADER:
            raise p.Overloaded(f"this connection holds {held} leases, its limit; release some and retry")

    def add(self, lease: int, conn: int) -> None:
        self.owner[lease] = conn
        self.by_owner.setdefault(conn, {})[lease] = None

    def check(self, lease: int, conn: int) -> None:
        """Raise NotFound unless ``conn`` owns ``lease``."""
        if self.owner.get(lease) != conn:
            raise not_found(lease)

    def drop(self, lease: int) -> int | None:
        """Forget ``lease``; returns the connection that owned it (None: no such lease)."""
        conn = self.owner.pop(lease, None)
        if conn is not None:
            held = self.by_owner[conn]
            del held[lease]
            if not held:
                del self.by_owner[conn]
        return conn

    def leases_of(self, conn: int) -> list[int]:
        return list(self.by_owner.get(conn, ()))

    def __len__(self) -> int:
        return len(self.owner)

    def __contains__(self, lease: object) -> bool:
        return lease in self.owner
