"""The worker side of the connector: one tpcache rank per vLLM worker (TP rank).

Once per engine step, at the step's first connector hook (``wait_for_layer_load`` of the first
attention layer when vLLM runs a forward pass, else ``start_load_kv`` or ``wait_for_save``), the
worker applies the step's ``StepOps`` in order to its ``EngineCache`` (lookups, loads, saves,
releases: the same sequenced operations on every rank). The copies they issue go by layer: a
load's layers are copied from then on and each is waited for before vLLM's attention reads that
layer; a save's layer starts when vLLM hands the layer over (``save_kv_layer``), every layer it did
not hand over at ``wait_for_save``. With copies after the forward pass instead, the step's sync
loads, which lead its operations, are applied (and copied) in ``start_load_kv``, which vLLM then
calls before the forward pass, and the rest in ``wait_for_save``: the same order on every rank.
``wait_for_save`` (every worker calls it every step, empty steps included, after the forward pass)
waits for every copy of the step and then runs exactly one round. What it reports for the step is
read from the state that round agreed:

- a lookup's hit (the pages its lease holds on host, storage prefetch included) once its prefetch
  is done, or in the step whose ops carry its ``answer`` (the scheduler's timeout: every rank
  applies it in the same step), or after ``lookup_timeout_rounds`` rounds where that is not 0; a
  closed cache reports 0;
- a load as finished once its outcome is agreed; pages past the agreed count, or every page when
  the cache closed first, are invalid blocks, which vLLM recomputes; a sync load's outcome in the
  step it was issued in (every copy of a step lands within it: one whose landing the round has not
  agreed counts as failed), as invalid blocks and in ``WorkerReport.sync_loads``, never as finished;
- a finished request as done sending once its lease is released, which waits for every copy of its
  blocks to be agreed (or at once when the cache is closed: no copy outlives its step, none is left
  running into the blocks).

After the cache fails closed the worker asks for an agreed flush (every rank does so in the same
round), which reopens it empty; requests in flight then simply miss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from protocol.round_vector import HEALTH_IO_ERROR
from tpcache.core import CacheClosed, Transfer
from tpcache.engine.external import EngineCache
from tpcache.integrations.vllm.faults import FaultPlan
from tpcache.integrations.vllm.layout import leading_unheld, page_ids
from tpcache.integrations.vllm.logs import LOGGER
from tpcache.integrations.vllm.messages import ANSWER, FLUSH, LOAD, LOOKUP, RELEASE, SAVE, StepOps, WorkerReport

log = logging.getLogger(LOGGER)

# A lookup whose prefix another request is bringing in starts over under a new lease at most this
# often (each time from a longer prefix), so a lookup always ends.
MAX_RELOCKS = 4
STALL_LOG_STEPS = 5000  # a rank busy this many steps in a row logs what it waits for


@dataclass
class _Lookup:
    lease: int | None  # None: the request holds nothing (dropped when the cache closed)
    tokens: list[int]
    rounds: int = 0
    relocks: int = 0
    reported: bool = False
    answer: bool = False  # the scheduler said to stop waiting for its prefetch (an ``answer`` op)


@dataclass
class _Load:
    op: Transfer | None
    blocks: list[int]
    sync: bool = False


def is_sync_load(op: tuple) -> bool:
    return op[0] == LOAD and len(op) > 4 and bool(op[4])


@dataclass
class StepResult:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)  # several KV cache groups: loads that failed
    report: WorkerReport = field(default_factory=WorkerReport)


class WorkerSide:
    def __init__(
        self,
        cache: EngineCache,
        *,
        lookup_timeout_rounds: int = 0,
        reopen: bool = True,
        faults: FaultPlan | None = None,
    ) -> None:
        self.cache = cache
        self.faults = faults
        self.page_size = cache.config.page_size
        self.lookup_timeout_rounds = lookup_timeout_rounds  # 0: no cap in rounds (the scheduler's answer ops)
        self.reopen = reopen
        self.requests: dict[str, _Lookup] = {}
        self.loads: dict[str, _Load] = {}
        self.sending: dict[str, int | None] = {}  # request -> lease being released (None: nothing held)
        self.steps = 0
        self.counters = {"load_failed_blocks": 0, "lookups": 0, "hit_tokens": 0, "storage_hit_tokens": 0, "closes": 0}
        self._flush_asked = False
        self._busy_steps = 0  # consecutive steps that ended with something still to report
        self._closed_reason = ""  # the reason of the last close this rank announced
        self._was_closed = False  # the cache was closed after the last step
        self._ops: list[tuple] | None = None  # this step's operations, once its first were applied
        self._next = 0  # the first of them not applied yet
        self._step = -1  # the scheduler's number of this step (``StepOps.step``), for the report

    # ------------------------------------------------------------------ one engine step

    def run_step(self, meta: StepOps | None) -> StepResult:
        """Apply the step's operations, run the round, collect what it agreed."""
        self.begin_step(meta)
        return self.end_step()

    def begin_step(self, meta: StepOps | None, sync_loads_only: bool = False) -> None:
        """Apply the step's operations not applied yet (at the step's first connector hook: before
        vLLM's forward pass where it calls one there). Copies they issue from now until ``end_step``
        go by layer. ``sync_loads_only``: only the sync loads that lead them."""
        if self._ops is None:
            if self.faults is not None:
                self.faults.step = self.steps
            self.cache.transfer.begin_step()
            self._ops, self._next = (list(meta.ops) if meta is not None else []), 0
            self._step = meta.step if meta is not None else -1
        ops, end = self._ops, len(self._ops)
        if sync_loads_only:
            end = self._next
            while end < len(ops) and is_sync_load(ops[end]):
                end += 1
        todo, self._next = ops[self._next : end], end
        for op in todo:
            try:
                self._apply(op)
            except CacheClosed:
                pass  # a closed cache serves misses; loads that could not start are failed below
            except Exception:  # noqa: BLE001 - a bad op must not kill the worker; the round checks ranks agree
                log.exception("tpcache: could not apply %s for request %s", op[0], op[1])

    def layer_computed(self, layer: int) -> None:
        """vLLM wrote this step's KV of attention layer ``layer``: its saves start."""
        self.cache.transfer.layer_computed(layer)

    def wait_layer(self, layer: int) -> None:
        """Return once this step's loads landed layer ``layer``."""
        self.cache.transfer.wait_layer(layer)

    def end_step(self) -> StepResult:
        """Wait for every copy of the step (saves of layers vLLM did not hand over start now), then
        run the step's one round and collect what it agreed."""
        if self._ops is not None and self._next < len(self._ops):
            self.begin_step(None)  # what the step's first hooks left (none where they applied all)
        self._ops, step, self._step = None, self._step, -1
        self.cache.transfer.end_step()
        if self.faults is not None and self.faults.diverges_now():
            log.warning("tpcache: injecting a divergence on rank %d at step %d", self.cache.rank, self.steps)
            self.cache.release(self.cache.lock([0] * self.page_size)[0])
        report = self.cache.step()
        self.steps += 1
        self._busy_steps = 0 if self.idle() else self._busy_steps + 1
        if self._busy_steps and self._busy_steps % STALL_LOG_STEPS == 0:
            rank, waiting = self.cache.rank, self.waiting()
            log.warning("tpcache rank %d: busy for %d steps, waiting on %s", rank, self._busy_steps, waiting)
        if report.flushed:
            self._flush_asked = False
        closed = self.cache.core.closed
        self._announce(closed)
        if closed:
            self._drop_leases()
            if self.reopen and not self._flush_asked:
                self._flush_asked = True
                self.cache.request_flush()
        return self._collect(closed, step)

    def _announce(self, closed: bool) -> None:
        """A close is a warning that names its cause and what it means for vLLM, once per cause (the
        round logs every close as an error; a close that recurs after each reopen says no more)."""
        reason = self.cache.core.closed_reason or "unknown"
        if closed and not self._was_closed:
            self.counters["closes"] += 1  # every time it closes, whatever the cause
        self._was_closed = closed
        if closed and reason != self._closed_reason:
            self._closed_reason = reason
            then = "until the ranks reopen it by an agreed flush" if self.reopen else "from now on (reopen is off)"
            log.warning(
                "tpcache rank %d: the cache closed (%s): it serves no hits %s; vLLM computes those prefixes",
                self.cache.rank,
                reason,
                then,
            )

    def _drop_leases(self) -> None:
        """A closed cache serves nothing, so requests let go of what they hold. Its ranks may have
        counted different operations (why it closed): a lease kept across the flush would carry a
        different id on each rank and keep their states apart after it. Nothing new is locked
        until the cache is open again."""
        for state in self.requests.values():
            if state.lease is not None:
                self.cache.release(state.lease)
                state.lease = None

    def _apply(self, op: tuple) -> None:
        kind, req = op[0], op[1]
        cache = self.cache
        if kind == LOOKUP:
            old = self.requests.pop(req, None)
            if old is not None and old.lease is not None:
                cache.release(old.lease)
            tokens = list(op[2])
            state = self.requests[req] = _Lookup(None, tokens)
            self.counters["lookups"] += 1
            if cache.core.closed:
                return
            state.lease = cache.lock(tokens)[0]
            if cache.config.storage:
                cache.prefetch(state.lease)
        elif kind == LOAD:
            state = self.requests.get(req)
            skip = leading_unheld(cache.engine_kv, op[3])  # pages before every group's window
            first, blocks = op[2] + skip, page_ids(cache.engine_kv, [g[skip:] for g in op[3]], save=False)
            self.loads[req] = _Load(None, blocks, is_sync_load(op))  # failed unless the op is issued
            if state is not None and state.lease is not None:
                self.loads[req].op = cache.load_into(state.lease, first, blocks)
        elif kind == SAVE:
            state = self.requests.get(req)
            if state is None:
                return
            state.tokens.extend(op[2])
            pages, blocks = op[3], page_ids(cache.engine_kv, op[4], save=True)
            if cache.core.closed:
                return
            if state.lease is None:  # dropped while the cache was closed: hold the saves anew
                state.lease = cache.lock(state.tokens)[0]
            cache.save(state.lease, state.tokens[: pages * self.page_size], blocks)
        elif kind == RELEASE:
            state = self.requests.pop(req, None)
            if state is None:
                return
            if state.lease is not None:
                cache.release(state.lease)
            if op[2]:
                self.sending[req] = state.lease
        elif kind == FLUSH:
            cache.request_flush()
        elif kind == ANSWER:
            state = self.requests.get(req)
            if state is not None:
                state.answer = True
        else:
            raise ValueError(f"unknown connector op {kind!r}")

    def _collect(self, closed: bool, step: int) -> StepResult:
        cache = self.cache
        out = StepResult(report=WorkerReport(closed=closed, step=step))
        for req, state in self.requests.items():
            if state.reported:
                continue
            state.rounds += 1
            status, ready = ("none", 0) if state.lease is None else cache.prefetch_status(state.lease)
            capped = self.lookup_timeout_rounds and state.rounds > self.lookup_timeout_rounds
            waiting = not (state.answer or capped or closed)
            if waiting and status not in ("none", "done"):
                continue
            if not closed and state.lease is not None:
                held = cache.hit_pages(state.lease)
                if waiting and cache.filling(state.tokens, held):
                    continue  # another request is bringing the next page in (its own fetch or save)
                if cache.match(state.tokens).host_pages > held and state.relocks < MAX_RELOCKS:
                    # Pages another request fetched meanwhile: pin them under a fresh lease, and
                    # look for the rest of the prompt in storage from there.
                    state.relocks += 1
                    cache.release(state.lease)
                    state.lease = cache.lock(state.tokens)[0]
                    if cache.config.storage and waiting and cache.prefetch(state.lease):
                        continue
            hit = 0 if closed or state.lease is None else self._hit_pages(state) * self.page_size
            storage = min(ready * self.page_size, hit)
            out.report.hits[req] = (hit, storage)
            state.reported = True
            self.counters["hit_tokens"] += hit
            self.counters["storage_hit_tokens"] += storage
        for req in list(self.loads):
            load = self.loads[req]
            landed = cache.outcome(load.op) if load.op is not None else 0
            if landed is None and not closed and not load.sync:
                continue
            landed = landed or 0
            bad = load.blocks[landed:]
            if load.sync:  # vLLM scheduled the request: it drops this step's tokens of it if bad
                out.report.sync_loads[req] = not bad
            else:
                out.finished_recving.add(req)
            if bad and cache.engine_kv.num_groups > 1 and not load.sync:
                out.failed_recving.add(req)
            else:
                out.invalid_blocks.update(bad)
            self.counters["load_failed_blocks"] += len(bad)
            del self.loads[req]
        for req in list(self.sending):
            lease = self.sending[req]
            if closed or lease is None or not cache.lease_alive(lease):
                out.finished_sending.add(req)
                del self.sending[req]
        out.report.busy = not self.idle()
        return out

    def _hit_pages(self, state: _Lookup) -> int:
        """The lookup's hit in pages. With a recurrent-state (Mamba) group it ends at a page that
        carries its state, and before the prompt's last token (vLLM computes that one itself, so
        the state of every boundary past it is never asked for)."""
        cache = self.cache
        assert state.lease is not None
        if cache.engine_kv.state_flag_part is None:
            return cache.hit_pages(state.lease)
        return cache.state_hit_pages(state.lease, (len(state.tokens) - 1) // self.page_size)

    def waiting(self) -> dict[str, Any]:
        """What this rank still has to report (for logs when an engine seems stuck)."""
        return {
            "lookups": [r for r, s in self.requests.items() if not s.reported],
            "loads": list(self.loads),
            "sending": list(self.sending),
            "copies_in_flight": sorted(self.cache.shell.running),
            "ops_to_agree": self.cache.core.ops_in_flight_by_kind(),
            "closed": self.cache.core.closed_reason,
        }

    def fail(self, reason: str) -> None:
        """Close this rank's cache and tell the others in the next round (a health bit): from then
        on every rank reports its loads failed and its lookups as misses."""
        self.cache.core.close(reason)
        self.cache.shell.health_bits |= HEALTH_IO_ERROR

    def idle(self) -> bool:
        """Nothing waits for a later round: no copy in flight, no lookup, load or release to report."""
        if self.loads or self.sending or any(not s.reported for s in self.requests.values()):
            return False
        return not self.cache.core.ops_in_flight() or self.cache.core.closed

    def totals(self) -> dict[str, int]:
        """Running totals of the counts this rank reports to vLLM's stats (cheap: no copies)."""
        core = self.cache.core.stats
        return {
            "loaded_pages": core.loads_done_pages,
            "failed_load_blocks": self.counters["load_failed_blocks"],
            "saved_pages": core.backups_done_pages,
            "storage_written_pages": core.storage_written_pages,
            "host_evicted_pages": core.host_evicted_pages,
            "closes": self.counters["closes"],
        }

    def stats(self) -> dict[str, Any]:
        out = dict(self.cache.stats())
        out.update(self.counters)
        out["requests"] = len(self.requests)
        waiting = sum(not s.reported for s in self.requests.values())
        in_flight = self.cache.core.ops_in_flight()
        out["pending"] = in_flight + len(self.loads) + len(self.sending) + waiting
        out["host_pages"] = self.cache.config.host_pages
        out["page_size"] = self.page_size
        out["kv_groups"] = self.cache.engine_kv.num_groups  # vLLM's KV cache groups in a page
        out["sliding_groups"] = sorted(self.cache.engine_kv.nullable)
        out["state_groups"] = sorted(self.cache.engine_kv.states)  # Mamba groups
        out["closed_reason"] = self.cache.core.closed_reason or ""
        out["flush_requested"] = int(self.cache.core.flush_requested)
        out["drained"] = int(self.cache.shell.drained())
        out["copies_in_flight"] = sorted(self.cache.shell.running)  # op ids not finished on this rank
        out["storage"] = self.cache.storage.stats() if self.cache.storage is not None else {}
        out["copies"] = dict(self.cache.transfer.counters)  # copies by layer (tpcache.io.engine_kv)
        return out
