"""The scheduler side of the connector: it never guesses what tpcache holds.

A new request's lookup goes to the workers in the next step's ``StepOps``; until the workers'
agreed result has come back (``WorkerReport``, the minimum over ranks, computed after a round that
passed with every rank equal), ``num_new_matched_tokens`` answers None and vLLM asks again next
step. An agreed hit is pages on the host tier that the request's lease pins (storage pages are
read into the host tier before the hit is reported), so it can be loaded in either of vLLM's ways:

- synchronously (``sync``): vLLM schedules the request in the step that allocates its blocks, and
  the workers copy the pages before that step's forward pass reads them (the step's sync loads
  lead its operations). Pages that did not land on every rank come back, in the same step, as
  invalid blocks: vLLM drops what the step computed for the request and computes again from the
  first of them. Until that outcome is reported no save names a block the load wrote, nor one of a
  request that read it (KV computed from a failed load never reaches tpcache).
- asynchronously: the request waits in WAITING_FOR_REMOTE_KVS until every worker reported the
  load's agreed outcome; pages that did not land on every rank come back as invalid blocks (by
  request with several KV cache groups) and vLLM recomputes them.

Per scheduled request the full pages computed by the end of a step are saved (their blocks named
in the same step's ops, copied by the workers after the forward pass). A finished request's last
pages are saved and its lease released in the next step; vLLM keeps its blocks until every worker
reports the release agreed (``request_finished`` returns True), except for a request whose load is
still pending: vLLM itself then frees the blocks when that load is reported.

A request vLLM preempted lost its blocks; its hit agreed before is stale (the pages it saved since
are in tpcache). When vLLM asks for it again, it is looked up again over every token it has, so
that what it saved is loaded back instead of computed again. Likewise a request still waiting
whose hit another request's save has since extended (the page after its hit, by vLLM's block hash)
is looked up again, at most ``MAX_REFRESHES`` times, before vLLM allocates for it.

A lookup waits for its storage prefetch for at most ``lookup_timeout_s`` seconds, by this process's
clock: a lookup still unanswered that long gets an ``answer`` op in the next step, and every worker
then reports what has landed in the same round (the ranks never decide by their own clocks). Its
seconds count from the report of the step that carried it (the workers applied it and ran a round
by then; a step whose forward pass is long would otherwise spend them before the workers ran one
round for it), and count again from the start once the engine's first forward pass is reported:
vLLM may compile there, for seconds the ranks spend in one step and so one round, which say
nothing about storage. The decision stays this process's alone, taken once, and travels in the step's ops. A
lookup sent again (preemption, a stale hit) waits afresh.

A Mamba group (``state_groups``) has one block per request, which holds the state after the tokens
computed so far. A save names it for the page that ends where the step's tokens end (the state of
that boundary, copied after the step's forward pass, before the next one overwrites it) and the
null block for every other page (stored as "no state"). A load names it for the hit's last page:
the workers' hit already ends at a page that carries its state.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tpcache.integrations.vllm.layout import NULL_BLOCK
from tpcache.integrations.vllm.logs import LOGGER
from tpcache.integrations.vllm.messages import ANSWER, FLUSH, LOAD, LOOKUP, RELEASE, SAVE, StepOps, WorkerReport

log = logging.getLogger(LOGGER)

STALL_LOG_STEPS = 5000  # requests still waiting on the same lookups or loads after this many steps are logged
MAX_REFRESHES = 2  # a waiting request is looked up again at most this often because of later saves
SAVED_PAGES_KEPT = 1 << 16  # vLLM block hashes of recently saved pages remembered (oldest dropped first)


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
    preemptions: int = 0  # vLLM's preemption count of the request when last seen
    computed: int = 0  # tokens computed by the end of the last step it was scheduled in
    before_preemption: int = 0  # tokens it had computed when vLLM last preempted it
    lookup_step: int = 0  # the step whose ops carried its last lookup
    waiting_since: float | None = None  # when its last lookup's seconds began (None: not yet reported received)
    answer_sent: bool = False  # the workers were told to answer its last lookup with what landed
    refreshes: int = 0  # lookups repeated because a later save made the hit stale
    load_failed: bool = False  # a load of it failed on some rank: its hit is not offered again
    load_step: int = 0  # the step whose ops carried its last load


class SchedulerSide:
    def __init__(
        self,
        block_size: int,
        kv_cache_manager: Any = None,
        state_groups: Sequence[int] = (),
        *,
        sync_loads: bool = False,
        lookup_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``state_groups``: the KV cache groups holding a recurrent state (one block a request).
        ``sync_loads``: hits are loaded synchronously (see the module docstring); only with one KV
        cache group, where vLLM can map invalid blocks back to requests. ``lookup_timeout_s``:
        seconds a lookup waits for its storage prefetch, by ``clock``."""
        self.block_size = block_size
        self.lookup_timeout_s = lookup_timeout_s
        self.clock = clock
        self.state_groups = frozenset(state_groups)
        self.kv_cache_manager = kv_cache_manager
        self.sync_loads = sync_loads
        self.requests: dict[str, _Request] = {}
        self.ops: list[tuple] = []
        self.sync_ops: list[tuple] = []  # this step's sync loads: they lead the step's operations
        # request -> blocks of its sync load whose outcome is not reported yet (no save names them)
        self.unconfirmed: dict[str, set[int]] = {}
        self.step = 0
        self._waiting: list[str] = []  # requests waiting at the last stall check
        self.workers_busy = False  # the last report said some worker has copies or releases to agree
        self.first_forward: int | None = None  # the step that ran the engine's first forward pass
        self.warm = False  # that step's report came back
        # running totals for vLLM's stats (tpcache.integrations.vllm.stats)
        # vLLM block hash -> the step whose ops last named that page in a save (bounded: the oldest
        # go first, counted in saved_pages_forgotten)
        self.saved_at: OrderedDict[Any, int] = OrderedDict()
        self.saved_pages_forgotten = 0
        self.counters = {
            "stale_lookups_refreshed": 0,
            "hit_tokens_host": 0,
            "hit_tokens_storage": 0,
            "lookups": 0,
            "preemptions": 0,
            "preempted_loaded_tokens": 0,
            "preempted_recomputed_tokens": 0,
            "load_wait_steps": 0,
        }

    # ------------------------------------------------------------------ vLLM hooks

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = _Request(request, sent_tokens=0)
            self._lookup(state)
            return None, False
        preemptions = getattr(request, "num_preemptions", 0)
        if preemptions > state.preemptions:
            # vLLM preempted the request and freed its blocks: the hit agreed before is stale (its
            # own saves since then are in tpcache). Look it up again before vLLM allocates for it.
            state.preemptions = preemptions
            state.before_preemption = state.computed
            self.counters["preemptions"] += 1
            self._lookup(state)
            return None, False
        if state.hit is None or state.loading:
            return None, False
        if self._stale(state):
            # Another request saved the page after this one's hit since the lookup: ask again, so
            # that vLLM allocates for what tpcache holds now.
            state.refreshes += 1
            self.counters["stale_lookups_refreshed"] += 1
            self._lookup(state)
            return None, False
        state.local = num_computed_tokens
        # vLLM computes at least the last prompt token itself (it samples from its logits).
        usable = min(state.hit, (request.num_tokens - 1) // self.block_size * self.block_size)
        if self.state_groups and usable != state.hit:
            usable = 0  # the state tpcache holds is the one at the hit's end, no shorter one
        extra = usable - num_computed_tokens
        return (extra, not self.sync_loads) if extra > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """``block_ids``: the request's blocks per KV cache group."""
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.local // self.block_size
        pages = num_external_tokens // self.block_size
        blocks = [
            [NULL_BLOCK] * (pages - 1) + list(group[:1]) if g in self.state_groups else list(group[first:][:pages])
            for g, group in enumerate(block_ids)
        ]
        state.load_blocks = tuple(b for group in blocks for b in group)
        state.load_step = self.step
        if self.sync_loads:
            self.sync_ops.append((LOAD, request.request_id, first, blocks, True))
            self.unconfirmed[request.request_id] = set(state.load_blocks)
        else:
            self.ops.append((LOAD, request.request_id, first, blocks))
            state.loading = True
        host, storage = self.hit_sources(request, num_external_tokens)
        self.counters["hit_tokens_host"] += host
        self.counters["hit_tokens_storage"] += storage
        if state.preemptions:
            self.counters["preempted_loaded_tokens"] += num_external_tokens

    def hit_sources(self, request: Any, num_external_tokens: int) -> tuple[int, int]:
        """(host, storage) split of a load's tokens: storage pages are the hit's tail."""
        state = self.requests.get(request.request_id)
        storage = 0 if state is None else min(state.storage_hit, num_external_tokens)
        return num_external_tokens - storage, storage

    def build_meta(self, scheduler_output: Any) -> StepOps:
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, n in scheduled.items():
            state = self.requests.get(req_id)
            if state is None:
                continue
            computed = state.request.num_computed_tokens
            if state.before_preemption > computed:
                redo = min(computed + n, state.before_preemption) - computed
                self.counters["preempted_recomputed_tokens"] += redo
            state.computed = max(state.computed, computed + n)
            if not state.loading:
                self._save(state, computed + n)
        if self.step % STALL_LOG_STEPS == 0:
            waiting = [r for r, s in self.requests.items() if s.hit is None or s.loading]
            if waiting and waiting == self._waiting:
                log.warning("tpcache: requests waiting on lookups or loads since step %d: %s", self.step, waiting)
            self._waiting = waiting
        if self.first_forward is None and any(n > 0 for n in scheduled.values()):
            self.first_forward = self.step
        self._answer_overdue()
        meta = StepOps(step=self.step, ops=self.sync_ops + self.ops)
        self.ops, self.sync_ops = [], []
        self.step += 1
        return meta

    def update_from_output(
        self,
        report: WorkerReport | None,
        finished_recving: set[str] | None,
        invalid_blocks: set[int] | None = None,
        failed_recving: set[str] | None = None,
    ) -> None:
        self.workers_busy = report is not None and report.busy
        if report is not None:
            for req_id, (hit, storage) in report.hits.items():
                state = self.requests.get(req_id)
                if state is not None and state.hit is None:
                    state.hit, state.storage_hit = hit, storage
            for req_id, landed in report.sync_loads.items():
                # vLLM recomputes from the first invalid block of a failed one (same output)
                self.unconfirmed.pop(req_id, None)
                state = self.requests.get(req_id)
                if state is not None and not landed:
                    state.hit = 0
                    state.load_failed = True
            self._start_clocks(report.step)
        for req_id in finished_recving or ():
            state = self.requests.get(req_id)
            if state is not None:
                self.counters["load_wait_steps"] += self.step - state.load_step
                state.loading = False
                failed = failed_recving is not None and req_id in failed_recving
                if failed or (invalid_blocks and not invalid_blocks.isdisjoint(state.load_blocks)):
                    # Some rank did not get the pages: vLLM recomputes them, and is not offered the
                    # hit again (a retried load would hit the same fault).
                    state.hit = 0
                    state.load_failed = True

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
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

    def _lookup(self, state: _Request) -> None:
        """Ask the workers for the request's hit over every token it has now."""
        tokens = list(state.request.all_token_ids)
        state.sent_tokens = len(tokens)
        state.hit, state.storage_hit = None, 0
        state.lookup_step = self.step
        state.waiting_since, state.answer_sent = None, False
        self.counters["lookups"] += 1
        self.ops.append((LOOKUP, state.request.request_id, tokens))

    def _start_clocks(self, step: int) -> None:
        """The workers reported step ``step``'s round: the seconds of the lookups it or an earlier
        step carried start now, and every unanswered lookup's start over if it is the report of
        the engine's first forward pass."""
        if step < 0:
            return
        now = self.clock()
        warmed = not self.warm and self.first_forward is not None and step >= self.first_forward
        self.warm = self.warm or warmed
        for state in self.requests.values():
            if state.hit is None and step >= state.lookup_step and (warmed or state.waiting_since is None):
                state.waiting_since = now

    def _answer_overdue(self) -> None:
        """Tell the workers to answer every lookup unanswered for ``lookup_timeout_s`` with what
        has landed (once a lookup; after this step's other ops, so after any lookup they carry)."""
        now = self.clock()
        for req_id, state in self.requests.items():
            if state.hit is not None or state.answer_sent or state.waiting_since is None:
                continue
            if now - state.waiting_since >= self.lookup_timeout_s:
                state.answer_sent = True
                self.ops.append((ANSWER, req_id))

    def _stale(self, state: _Request) -> bool:
        """Whether the page right after the request's agreed hit was named in a save since its
        lookup (by vLLM's block hash of that page, which chains every token before it)."""
        if state.load_failed or state.refreshes >= MAX_REFRESHES or state.hit is None:
            return False
        request = state.request
        page = state.hit // self.block_size
        if page >= (request.num_tokens - 1) // self.block_size:
            return False  # the hit already covers every page vLLM would load
        hashes = getattr(request, "block_hashes", None) or ()
        if page >= len(hashes):
            return False
        saved = self.saved_at.get(hashes[page])
        return saved is not None and saved >= state.lookup_step

    def _remember_saved(self, request: Any, first: int, pages: int) -> None:
        hashes = getattr(request, "block_hashes", None) or ()
        for i in range(first, min(pages, len(hashes))):
            self.saved_at[hashes[i]] = self.step
            self.saved_at.move_to_end(hashes[i])
        while len(self.saved_at) > SAVED_PAGES_KEPT:
            self.saved_at.popitem(last=False)
            self.saved_pages_forgotten += 1

    def _save(self, state: _Request, computed: int, block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Name the blocks (per KV cache group) of the full pages whose KV is computed and whose
        tokens are known. A sliding-window group's blocks freed behind its window are vLLM's null
        block here: the workers save no page from the first one of those past what they hold."""
        request = state.request
        known = min(computed, request.num_tokens)
        pages = known // self.block_size
        if pages <= state.saved_pages:
            return
        if block_ids is None:
            if self.kv_cache_manager is None:
                return
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        pages = min(pages, *(len(group) for g, group in enumerate(block_ids) if g not in self.state_groups))
        if pages <= state.saved_pages:
            return
        if self.unconfirmed and self._reads_unconfirmed(block_ids, pages):
            return  # named once the sync load it read is reported landed (or after vLLM recomputed)
        # A state block holds the state after ``computed`` tokens: the state of the last page's
        # boundary only when they end there.
        with_state = computed == pages * self.block_size
        named = [
            [NULL_BLOCK] * (pages - 1) + ([group[0]] if with_state and group else [NULL_BLOCK])
            if g in self.state_groups
            else list(group[:pages])
            for g, group in enumerate(block_ids)
        ]
        end = pages * self.block_size
        new = list(request.all_token_ids[state.sent_tokens : end]) if end > state.sent_tokens else []
        state.sent_tokens = max(state.sent_tokens, end)
        self._remember_saved(request, state.saved_pages, pages)
        state.saved_pages = pages
        self.ops.append((SAVE, request.request_id, new, pages, named))

    def _reads_unconfirmed(self, block_ids: Sequence[Sequence[int]], pages: int) -> bool:
        """Whether the first ``pages`` blocks include one a sync load wrote whose outcome is not
        reported yet (the request's own load, or vLLM's prefix cache sharing its block)."""
        blocks = {b for group in block_ids for b in group[:pages]}
        return any(not blocks.isdisjoint(loaded) for loaded in self.unconfirmed.values())
