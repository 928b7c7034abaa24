"""tpcache's host and storage tiers in vLLM's own KV-event stream, under vLLM's block hashes.

With vLLM's ``kv_events_config`` on, vLLM publishes what its block pool stores and removes (medium
``GPU``); the connector adds, through ``take_events``, the pages tpcache stores and removes on its
host tier (medium ``CPU``) and its storage tier (medium ``STORAGE``), each under vLLM's block hash of
the same block, so that a router that follows vLLM's stream sees every tier of one block under
one key.

- The worker side of TP rank 0 keeps the change feed of its core (``collect_changes``): after each
  round, what the round agreed (every rank's is the same), handed to the scheduler side in the
  step's ``WorkerReport``.
- The scheduler side (``BlockEvents``) knows each request's tokens and vLLM's block hashes: when an
  operation names a request's pages (its lookup, a save, its end), it computes tpcache's page
  hashes of them (``tpcache.core.hashing``: the same chain the workers' trees use) and keeps
  tpcache page hash -> vLLM block hashes (one page can be several blocks of vLLM's: a ``cache_salt``
  or LoRA changes vLLM's hash, not the tokens). The map is bounded (``MAPPED_PAGES``; the least
  recently used go first, counted in ``pages_forgotten``); a change to a page it does not know
  (forgotten, or stored before this engine named it) is left out and counted in ``pages_unmapped``.
- Events: ``BlockRemoved`` then ``BlockStored`` per tier per report, in the order the rounds changed
  them; a stored event has no parent and no token ids (each vLLM block hash already chains the
  blocks before it). A cleared cache (a flush, a close) is reported as the removal of every page the
  stream said was on a tier, never as ``AllBlocksCleared``, which would also clear vLLM's own blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from tpcache.core.hashing import as_token_bytes, extend_chain, namespace_seed, root_hash
from tpcache.core.treecore.feed import HOST, STORAGE, Changes
from tpcache.events.publisher import RoundStream
from tpcache.integrations.vllm.messages import LOOKUP, SAVE

MAPPED_PAGES = 1 << 18  # tpcache page hash -> vLLM block hashes kept (least recently used go first)
TIERS = (HOST, STORAGE)  # the tiers tpcache keeps under vLLM (vLLM's blocks are the device tier)


def enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


# ---------------------------------------------------------------------- worker side (TP rank 0)


class ChangeCollector:
    """The rounds' changes on the host and storage tiers, kept until the next report takes them.
    It stands in for a ``RoundStream``'s publisher (so a closed, reopened or rebuilt cache is told
    the same way as on the event stream)."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []

    def publish(self, changes: Changes) -> None:
        if changes:
            removed, stored = changes.removed, changes.stored
            self.pending.append((changes.cleared, removed[HOST], removed[STORAGE], stored[HOST], stored[STORAGE]))

    def take(self) -> list[tuple]:
        """``[(cleared, removed host, removed storage, stored host, stored storage), ...]``, oldest first."""
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        self.pending = []


def collect_changes(cache: Any) -> ChangeCollector:
    """Keep what each round of ``cache`` (an ``EngineCache``) changes, for ``WorkerReport.changes``."""
    collector = ChangeCollector()
    cache.events = RoundStream(collector, cache.core)  # run by ``cache.step()`` after each round
    return collector


# ---------------------------------------------------------------------- scheduler side


class BlockEvents:
    """vLLM events of tpcache's tiers (see the module docstring)."""

    def __init__(self, block_size: int, namespace: str, max_pages: int = MAPPED_PAGES) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

        self.block_size = block_size
        self.max_pages = max_pages
        self.seed, self.root = namespace_seed(namespace), root_hash(namespace)
        self.mediums = {HOST: MEDIUM_CPU, STORAGE: MEDIUM_STORAGE}
        self.requests: dict[str, tuple[Any, list[int]]] = {}  # req id -> (request, its pages' tpcache hashes)
        self.blocks: OrderedDict[int, list[Any]] = OrderedDict()  # tpcache page hash -> vLLM block hashes
        self.on: dict[int, int] = {}  # mapped page -> tiers it is on (a bit per tier), as reported so far
        self.events: list[Any] = []
        self.counters = {"pages_mapped": 0, "pages_forgotten": 0, "pages_unmapped": 0}

    def track(self, request: Any) -> None:
        """A request vLLM asks about (its pages get mapped when an operation names them)."""
        if request.request_id not in self.requests:
            self.requests[request.request_id] = (request, [])

    def saw(self, ops: list[tuple]) -> None:
        """The step's operations: map the pages of the requests they look up or save."""
        for op in ops:
            if op[0] in (LOOKUP, SAVE):
                entry = self.requests.get(op[1])
                if entry is not None:
                    self._map(*entry)

    def finished(self, request: Any) -> None:
        entry = self.requests.pop(request.request_id, None)
        if entry is not None:
            self._map(*entry)  # its last save goes out with the next step's operations

    def reported(self, changes: list[tuple] | None) -> None:
        """The changes the workers' last round(s) agreed, as vLLM events (kept for ``take``)."""
        for cleared, removed_host, removed_storage, stored_host, stored_storage in changes or ():
            if cleared:
                self._clear()
            self._removed(removed_host, HOST)
            self._removed(removed_storage, STORAGE)
            self._stored(stored_host, HOST)
            self._stored(stored_storage, STORAGE)

    def take(self) -> list[Any]:
        out, self.events = self.events, []
        return out

    # ------------------------------------------------------------------ internals

    def _map(self, request: Any, chain: list[int]) -> None:
        """Extend ``chain`` (tpcache's hashes of the request's pages) to the full pages vLLM has a
        block hash for, and map each new one to that block hash."""
        vllm_hashes = getattr(request, "block_hashes", None) or ()
        tokens = request.all_token_ids
        size = self.block_size
        n = min(len(vllm_hashes), len(tokens) // size)
        if n <= len(chain):
            return
        start = len(chain)
        new = extend_chain(
            chain[-1] if chain else self.root, as_token_bytes(tokens[start * size : n * size]), size, self.seed
        )
        chain += new
        blocks = self.blocks
        for i, h in enumerate(new, start):
            known = blocks.get(h)
            if known is None:
                blocks[h] = [vllm_hashes[i]]
                self.counters["pages_mapped"] += 1
            else:
                blocks.move_to_end(h)
                if vllm_hashes[i] not in known:
                    known.append(vllm_hashes[i])
        while len(blocks) > self.max_pages:
            gone, _ = blocks.popitem(last=False)
            self.on.pop(gone, None)
            self.counters["pages_forgotten"] += 1

    def _removed(self, hashes: list[int], tier: int) -> None:
        out: list[Any] = []
        bit = 1 << tier
        for h in hashes:
            bits = self.on.get(h, 0)
            if not bits & bit:
                self.counters["pages_unmapped"] += 1
                continue
            if bits == bit:
                del self.on[h]
            else:
                self.on[h] = bits & ~bit
            out += self.blocks[h]
        if out:
            self._emit_removed(out, tier)

    def _stored(self, hashes: list[int], tier: int) -> None:
        out: list[Any] = []
        bit = 1 << tier
        for h in hashes:
            known = self.blocks.get(h)
            if known is None:
                self.counters["pages_unmapped"] += 1
                continue
            self.blocks.move_to_end(h)
            self.on[h] = self.on.get(h, 0) | bit
            out += known
        if out:
            from vllm.distributed.kv_events import BlockStored
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            self.events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(b) for b in out],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=self.mediums[tier],
                    lora_name=None,
                )
            )

    def _clear(self) -> None:
        """Everything the stream said was on a tier left it."""
        for tier in TIERS:
            bit = 1 << tier
            out = [b for h, bits in self.on.items() if bits & bit for b in self.blocks[h]]
            if out:
                self._emit_removed(out, tier)
        self.on.clear()

    def _emit_removed(self, vllm_hashes: list[Any], tier: int) -> None:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self.events.append(
            BlockRemoved(block_hashes=[maybe_convert_block_hash(b) for b in vllm_hashes], medium=self.mediums[tier])
        )
