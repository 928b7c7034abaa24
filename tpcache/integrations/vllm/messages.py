"""What travels between the scheduler-side connector and the workers, once per engine step.

Scheduler -> every worker (``StepOps``, inside vLLM's scheduler output): the step's sequenced
operations in the order the scheduler decided them. Every worker receives the same object, so every
tpcache rank applies the same operations in the same order, which is what keeps their trees equal.

Worker -> scheduler (``WorkerReport``, merged over the workers by vLLM with ``aggregate``): the
lookups whose result became agreed in this step's round. The merge keeps, per request, the minimum
over workers (a worker that did not report a request counts as a miss), so the scheduler is never
told more than every rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

# Operations, as plain tuples (cheap to pickle to every worker):
#   ("lookup", req_id, token_ids)                     lock the longest cached prefix, prefetch from storage
#   ("load", req_id, first_page, block_ids[, sync])   copy hit pages first_page.. into the request's blocks
#                                                     (sync: before this step's forward pass; sync loads
#                                                     lead the step's operations)
#   ("save", req_id, new_token_ids, pages, block_ids) the request's first `pages` pages are in block_ids
#   (block_ids: one list per KV cache group, one block per page; a sliding-window group's null block
#   is a page it no longer holds)
#   ("release", req_id, delayed)                      the request finished; `delayed`: vLLM waits to free blocks
#   ("flush", "")                                     empty the cache (an agreed flush on every rank)
#   ("answer", req_id)                                stop waiting for the lookup's storage prefetch:
#                                                     report what has landed after this step's round
LOOKUP, LOAD, SAVE, RELEASE, FLUSH, ANSWER = "lookup", "load", "save", "release", "flush", "answer"


@dataclass
class StepOps(KVConnectorMetadata):
    step: int = 0
    ops: list[tuple] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    # req_id -> (hit tokens, of which read from storage): lookups agreed in this step's round
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)
    step: int = -1  # the step (``StepOps.step``) whose round this reports; -1: not known
    closed: bool = False
    busy: bool = False  # a worker still has copies or releases to agree: vLLM should keep stepping
    sync_loads: dict[str, bool] = field(default_factory=dict)  # this step's sync loads: landed on every rank?
    changes: list[tuple] | None = None  # TP rank 0, with vLLM's KV events on: the rounds' changes (events.py)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        if not isinstance(other, WorkerReport):
            return self
        hits: dict[str, tuple[int, int]] = {}
        for req in sorted(self.hits.keys() | other.hits.keys()):
            a, b = self.hits.get(req, (0, 0)), other.hits.get(req, (0, 0))
            total = min(a[0], b[0])
            hits[req] = (total, min(max(a[1], b[1]), total))
        synced = sorted(self.sync_loads.keys() | other.sync_loads.keys())
        sync = {r: self.sync_loads.get(r, False) and other.sync_loads.get(r, False) for r in synced}
        return WorkerReport(
            hits=hits,
            sync_loads=sync,
            closed=self.closed or other.closed,
            busy=self.busy or other.busy,
            changes=self.changes or other.changes,
            step=max(self.step, other.step),
        )
