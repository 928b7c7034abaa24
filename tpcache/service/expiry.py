"""Rank 0's decision that a lease is abandoned, carried to every rank as an EXPIRE entry.

A lease is abandoned when the connection that owns it is gone (including a lock whose reply
found nobody) or when no request named it for ``ttl_s`` seconds of rank 0's clock. Only rank 0
looks at that clock; every rank applies the resulting EXPIRE entries at the same point of the
sequence, so the cache state stays equal everywhere. A lease is in at most one EXPIRE entry.
"""

from __future__ import annotations

import logging
from typing import Any

from tpcache.service.leases import LeaseBook

log = logging.getLogger("tpcache.service")

MAX_EXPIRE_PER_ENTRY = 4096  # lease ids in one EXPIRE entry
TTL_SCAN_S = 1.0  # how often idle leases are looked for


class LeaseExpiry:
    def __init__(self, book: LeaseBook, ttl_s: float, now: float) -> None:
        self.book = book
        self.ttl_s = ttl_s
        self.gone: list[Any] = []  # connections that left, until no request of theirs is in flight
        self.expiring: set[int] = set()  # leases in an EXPIRE entry not yet applied
        self.used: dict[int, float] = {}  # lease -> when a request last named it
        self.last_scan = now
        self.decided: list[list[int]] = []  # EXPIRE entries to send, at most MAX_EXPIRE_PER_ENTRY ids each

    def expire(self, leases: list[int]) -> None:
        leases = [lease for lease in leases if lease not in self.expiring]
        for i in range(0, len(leases), MAX_EXPIRE_PER_ENTRY):
            chunk = leases[i : i + MAX_EXPIRE_PER_ENTRY]
            self.decided.append(chunk)
            self.expiring.update(chunk)

    def connections_gone(self, conns: list[Any]) -> None:
        self.gone.extend(conns)

    def touch(self, lease: int, now: float) -> None:
        if lease in self.book:
            self.used[lease] = now

    def applied(self, leases: list[int]) -> None:
        self.expiring.difference_update(leases)

    def scan(self, now: float) -> list[list[int]]:
        """The EXPIRE entries decided since the last call."""
        if self.gone:
            still = []
            for conn in self.gone:
                self.expire(self.book.leases_of(conn.id))
                if conn.server.num_pending:
                    still.append(conn)  # a lock of its may still be on its way: look again later
            self.gone = still
        ttl = self.ttl_s
        if ttl > 0 and now - self.last_scan >= min(TTL_SCAN_S, ttl):
            self.last_scan = now
            idle = []
            for lease, used in list(self.used.items()):
                if lease not in self.book:
                    del self.used[lease]
                elif now - used > ttl:
                    idle.append(lease)
            if idle:
                log.info("expiring %d lease(s) unused for more than %g s", len(idle), ttl)
            self.expire(idle)
        decided, self.decided = self.decided, []
        return decided
