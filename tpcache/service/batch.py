"""One batch and its round, as every rank applies it: the code the leader and followers share.

A batch is an ordered list of entries. Every rank applies them in order through the same
``RankHandler``, runs exactly one round, then finishes what waited for that round (``Deferred``
results). Because the core is deterministic and every entry carries everything a decision needs
(the request, the connection that sent it), every rank computes the same outcomes.

Entry kinds:

- ``REQUEST``: a client request; ``token`` is its sequence number (0 for a request the leader
  answers alone, which never leaves rank 0), ``conn`` the connection that sent it, ``data`` the
  client's frame (followers decode it; the leader passes the body it already decoded);
- ``ACTIVATE``: commit (``data`` true) or discard the staged buffers of registration ``token``;
- ``EXPIRE``: release the leases listed in ``data``, decided by the leader (their connection is
  gone, or they sat idle past the lease TTL): the only way a lease ends without its owner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import protocol as p
from tpcache.core.round import RoundReport
from tpcache.service.handlers import RankHandler
from tpcache.service.metrics import RankMetrics
from tpcache.service.ops import Ctx, Deferred, to_protocol_error

log = logging.getLogger("tpcache.service")

REQUEST, ACTIVATE, EXPIRE = 0, 1, 2
KINDS = (REQUEST, ACTIVATE, EXPIRE)
EXIT_GROUP_BROKEN = 4  # a rank's exit code once its round collective failed: restart the group


@dataclass(slots=True)
class Entry:
    kind: int
    token: int
    conn: int
    data: Any
    body: p.Body | None = None  # REQUEST: the decoded request (decoded from ``data`` when None)
    outcome: Any = None  # after ``apply_batch``: a Body, a ProtocolError or a leader-side wait

    def wire(self) -> list[Any]:
        """The entry as the internal channel carries it."""
        return [self.kind, self.token, self.conn, self.data]


def apply_batch(handler: RankHandler, metrics: RankMetrics, entries: Sequence[Entry], applied: int = 0) -> RoundReport:
    """Apply ``entries`` in order, run one round, finish the outcomes that waited for it.
    ``applied``: requests of this batch the caller applied before these (counted in the metrics)."""
    rank = handler.rank
    for entry in entries:
        if entry.kind == REQUEST:
            body = entry.body
            if body is None:
                try:
                    body = entry.body = p.decode_request(entry.data).body
                except p.ProtocolError as exc:
                    # The leader decoded this frame, so this rank's copy is not what it sent. Skipping
                    # it leaves this rank's sequence behind and the round closes the group.
                    log.error("rank %d: request %d could not be decoded (%s); skipped", rank, entry.token, exc)
                    entry.outcome = exc.with_traceback(None)  # (its frames would hold the batch)
                    continue
            try:
                entry.outcome = handler.apply(body, Ctx(entry.token, entry.conn))
            except p.ProtocolError as exc:
                entry.outcome = exc.with_traceback(None)  # (its frames would hold the batch)
        elif entry.kind == ACTIVATE:
            try:
                entry.outcome = handler.activate(entry.token, bool(entry.data))
            except p.ProtocolError as exc:
                log.warning("rank %d: registration %d: %s", rank, entry.token, exc.message)
                entry.outcome = exc.with_traceback(None)  # (its frames would hold the batch)
        else:
            handler.expire(entry.data)
    start = time.perf_counter()
    report = handler.tp.step()
    metrics.observe_round(time.perf_counter() - start, len(entries) + applied)
    for entry in entries:
        if isinstance(entry.outcome, Deferred):
            try:
                entry.outcome = entry.outcome.finish(report)
            except Exception as exc:  # noqa: BLE001 - mapped to a typed error
                entry.outcome = to_protocol_error(exc)
    return report
