"""The scheduler side of the connector: it never guesses what tpcache holds.

A new request's lookup goes to the workers in the next step's ``StepOps``; until the workers'
agreed result has come back (``WorkerReport``, the minimum over ranks, computed after a round that
passed with every rank equal), ``num_new_matched_tokens`` answers None and vLLM asks again next
step. A hit is loaded asynchronously: the request waits in WAITING_FOR_REMOTE_KVS until every
worker reported the load's agreed outcome; pages that did not land on every rank come back as
invalid blocks and vLLM recomputes them.

Per scheduled request the full pages computed by the end of a step are saved (their blocks named
in the same step's ops, copied by the workers after the forward pass). A finished request's last
pages are saved and its lease released in the next step; vLLM keeps its blocks until every worker
reports the release agreed (``request_finished`` returns True), except for a request whose load is
still pending: vLLM itself then frees the blocks when that load is reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tpcache.integrations.vllm.logs import LOGGER
from tpcache.integrations.vllm.messages import FLUSH, LOAD, LOOKUP, RELEASE, SAVE, StepOps, WorkerReport

log = logging.getLogger(LOGGER)

STALL_LOG_STEPS = 5000  # requests still waiting on the same lookups or loads after this many steps are logged


@dataclass
class _Request:
    request: Any  # vllm Request (live: its token ids and computed count grow)
    sent_tokens: int  # token ids the workers hold for it
    hit: int | None = None  # agreed hit in tokens; None until the workers' result arrived
    storage_hit: int = 0  # of which read from storage
    local: int = 0  # vLLM's own (block-aligned) prefix hit at the last ask
    loading: bool = False  # a load was sent and its outcome not reported yet
    load_blocks: tuple[int, ...] = ()  # the blocks of the last load
    saved_pages: int = 0  # pages named in a save already


class SchedulerSide:
    def __init__(self, block_size: int, kv_cache_manager: Any = None) -> None:
        self.block_size = block_size
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, _Request] = {}
        self.ops: list[tuple] = []
        self.step = 0
        self._waiting: list[str] = []  # requests waiting at the last stall check
        self.workers_busy = False  # the last report said some worker has copies or releases to agree

    # ------------------------------------------------------------------ vLLM hooks

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.requests.get(request.request_id)
        if state is None:
            tokens = list(request.all_token_ids)
            self.requests[request.request_id] = _Request(request, sent_tokens=len(tokens))
            self.ops.append((LOOKUP, request.request_id, tokens))
            return None, False
        if state.hit is None or state.loading:
            return None, False
        state.local = num_computed_tokens
        # vLLM computes at least the last prompt token itself (it samples from its logits).
        usable = min(state.hit, (request.num_tokens - 1) // self.block_size * self.block_size)
        extra = usable - num_computed_tokens
        return (extra, True) if extra > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.local // self.block_size
        pages = num_external_tokens // self.block_size
        blocks = list(block_ids[first : first + pages])
        self.ops.append((LOAD, request.request_id, first, blocks))
        state.loading = True
        state.load_blocks = tuple(blocks)

    def hit_sources(self, request: Any, num_external_tokens: int) -> tuple[int, int]:
        """(host, storage) split of a load's tokens: storage pages are the hit's tail."""
        state = self.requests.get(request.request_id)
        storage = 0 if state is None else min(state.storage_hit, num_external_tokens)
        return num_external_tokens - storage, storage

    def build_meta(self, scheduler_output: Any) -> StepOps:
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, n in scheduled.items():
            state = self.requests.get(req_id)
            if state is not None and not state.loading:
                self._save(state, state.request.num_computed_tokens + n)
        if self.step % STALL_LOG_STEPS == 0:
            waiting = [r for r, s in self.requests.items() if s.hit is None or s.loading]
            if waiting and waiting == self._waiting:
                log.warning("tpcache: requests waiting on lookups or loads since step %d: %s", self.step, waiting)
            self._waiting = waiting
        meta = StepOps(step=self.step, ops=self.ops)
        self.ops = []
        self.step += 1
        return meta

    def update_from_output(
        self, report: WorkerReport | None, finished_recving: set[str] | None, invalid_blocks: set[int] | None = None
    ) -> None:
        self.workers_busy = report is not None and report.busy
        if report is not None:
            for req_id, (hit, storage) in report.hits.items():
                state = self.requests.get(req_id)
                if state is not None and state.hit is None:
                    state.hit, state.storage_hit = hit, storage
        for req_id in finished_recving or ():
            state = self.requests.get(req_id)
            if state is not None:
                state.loading = False
                if invalid_blocks and not invalid_blocks.isdisjoint(state.load_blocks):
                    # Some rank did not get the pages: vLLM recomputes them, and is not offered the
                    # hit again (a retried load would hit the same fault).
                    state.hit = 0

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Queue the last save and the release; True when vLLM must wait for the workers to free."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return False
        delayed = not state.loading
        if delayed:
            self._save(state, request.num_computed_tokens, block_ids)
        self.ops.append((RELEASE, request.request_id, delayed))
        return delayed

    def reset(self) -> bool:
        """Empty tpcache (``LLM.reset_prefix_cache(reset_connector=True)``): every rank flushes in
        the same round, once none has a copy in flight; lookups meanwhile miss."""
        self.ops.append((FLUSH, ""))
        return True

    # ------------------------------------------------------------------ internals

    def _save(self, state: _Request, computed: int, block_ids: list[int] | None = None) -> None:
        """Name the blocks of the full pages whose KV is computed and whose tokens are known."""
        request = state.request
        known = min(computed, request.num_tokens)
        pages = known // self.block_size
        if pages <= state.saved_pages:
            return
        if block_ids is None:
            if self.kv_cache_manager is None:
                return
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        pages = min(pages, len(block_ids))
        if pages <= state.saved_pages:
            return
        end = pages * self.block_size
        new = list(request.all_token_ids[state.sent_tokens : end]) if end > state.sent_tokens else []
        state.sent_tokens = max(state.sent_tokens, end)
        state.saved_pages = pages
        self.ops.append((SAVE, request.request_id, new, pages, list(block_ids[:pages])))
