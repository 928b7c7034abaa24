"""Engine-owned device pages: tpcache holds the host (L2) and storage (L3) tiers under an engine's
own block pool (vLLM's), and copies between its host slots and the block ids the engine names.

Full attention only: a configuration with components (SWA pages, Mamba states) is refused.
The core runs with no device tier of its own (``device_pages == 0``): no node is ever on device,
and the engine's blocks never enter the tree. Two sequenced operations move KV across the border:

- ``save``: the KV of the full pages of ``tokens`` sits in the engine's ``blocks`` (``NOT_HELD``
  for a page the engine no longer holds whole: the save stops before it); the pages the
  cache does not hold yet (from the first one missing on host) get fresh host slots, their nodes go
  host-WRITING, and one BACKUP op copies block -> slot. The nodes become host-VALID only when the
  round agrees the copy landed on every rank; pages past an agreed partial ack are dropped.
- ``load_into``: copy pages of the lease's hit (host-VALID pages it pins, from ``lock`` or from a
  storage prefetch) into engine blocks with one LOAD op. Nothing in the tree changes; the op's
  ``acked`` (set by the agreed completion) tells the engine how many leading pages it may use.

Adopted device pages (``CacheConfig.device_adopt``, SGLang's KV pool) are the other way an engine
owns device pages: the core keeps a device tier, but its pages are the engine's (``AdoptedPages``).
``adopt`` inserts the pages a request computed into, taking them from the engine; eviction, releases
and a flush give page ids back, drained by the engine in the order the core freed them (``drain``).

Both ops carry ``engine_pages=True`` (their device side is the engine's block ids) and the lease
waits for them: a lease is released only once every copy into or out of its blocks is agreed
complete, which is when the engine may reuse them. The host slots a load reads are held by the
lease's own pins; the slots a save writes belong to its WRITING nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tpcache.core.config import CacheConfig
from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.inserts import Inserter
from tpcache.core.leases import Leases
from tpcache.core.outbox import Outbox
from tpcache.core.records import Lease, OpKind, Transfer
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.allocator import AdoptedPages
from tpcache.core.treecore.core import ROOT
from tpcache.core.treecore.eviction import Evictor


def require_engine_mode(config: CacheConfig) -> None:
    if config.device_pages != 0:
        raise ValueError("engine-owned device pages need a core without a device tier (device_pages=0)")
    if config.host_pages <= 0:
        raise ValueError("engine-owned device pages need a host tier (host_pages > 0)")
    if config.components():
        raise ValueError("engine-owned device pages serve full-attention models only (no swa_window, no mamba_every)")


NOT_HELD = -1  # in a save's blocks: the engine no longer holds this page (a sliding window freed it)


def check_blocks(blocks: Sequence[int]) -> list[int]:
    out = list(blocks)
    for b in out:
        if isinstance(b, bool) or not isinstance(b, int) or b < NOT_HELD:
            raise ValueError(f"blocks must be non-negative ints (or {NOT_HELD} in a save), found {b!r}")
    held = [b for b in out if b != NOT_HELD]
    if len(set(held)) != len(held):
        raise ValueError("blocks name a block twice")
    return out


class EnginePages:
    def __init__(
        self,
        core: TreeCore,
        leases: Leases,
        outbox: Outbox,
        evictor: Evictor,
        inserter: Inserter,
        live: Callable[[int], Lease],
    ) -> None:
        self.core = core
        self.ledger = ledger = core.ledger  # its pools and stats (no node is read through it)
        self.leases = leases
        self.outbox = outbox
        self.evictor = evictor
        self.inserter = inserter
        self.live = live  # the core's live-lease lookup: refuses a closed cache or a lease being released
        self.adopted = ledger.device if isinstance(ledger.device, AdoptedPages) else None

    # ------------------------------------------------------------------ adopted device pages

    def adopt(self, lease_id: int, tokens: TokenIds, pages: Sequence[int]) -> list[int]:
        """``insert`` the full pages of ``tokens``, whose KV the engine wrote into its ``pages`` (page
        i of the tokens in ``pages[i]``; ids past the full pages are ignored). A page the cache holds
        must be the page of the cached node at that position; every other page is taken from the
        engine and inserted as ``insert`` does. Returns the pages given that were not adopted (the
        tree has them under other pages), in order: they stay the engine's. A refused call
        changes nothing."""
        lease = self.live(lease_id)
        dev = self.adopted
        if dev is None:
            raise ValueError("adopt needs device_adopt (the engine's pages as the device tier); use alloc and insert")
        data = as_token_bytes(tokens)
        walk = self.core.walk(data)
        n = walk.num_pages
        given = list(pages)[:n]
        if len(given) < n:
            raise ValueError(f"adopt needs a device page for each of {n} full pages, got {len(given)}")
        ids = walk.ids
        cached = [self.core.device(i) for i in ids]  # (state, page): a page is on device where state != NONE
        for i, p in enumerate(given):
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < dev.num_pages:
                raise ValueError(f"pages must be ints in 0 .. {dev.num_pages - 1} (device_pages), found {p!r}")
            if dev.is_owned(p) and not (i < len(ids) and cached[i][0] != DeviceState.NONE and cached[i][1] == p):
                raise ValueError(f"page {p} is cached at another position of the tree; it cannot hold page {i}")
        foreign = [p for p in given if not dev.is_owned(p)]
        if len(set(foreign)) != len(foreign):
            raise ValueError("pages name a page twice")
        dev.take(foreign)
        lease.pages.extend(foreign)
        try:
            self.inserter.insert(lease, data, given)
        finally:
            left = set(lease.pages).intersection(foreign)
            if left:  # not adopted (or a refused insert): the engine's again, not freed
                lease.pages.discard(left)
                dev.untake([p for p in foreign if p in left])
                self.leases.refresh(lease)
        return [p for p in foreign if p in left]

    def load_adopted(self, lease_id: int, pages: Sequence[int]) -> Transfer | None:
        """With ``device_adopt`` and a host tier: bring the lease's host hit back into the engine's
        ``pages`` (page i of the hit's host-only part into ``pages[i]``) and adopt them there.

        The hit's host-only pages are those that follow its leading device pages, host-VALID and
        pinned by the lease (its ``lock``). The nodes are adopted as ``adopt`` would adopt pages the
        engine computed, and one LOAD op copies their host slots into ``pages``; the lease keeps the
        slots pinned and its release waits for the op. The engine's copy of such an op lands before
        its submit returns (``EngineTransfer`` outside a step), so the engine checks it landed on its
        rank before it reads the pages (and stops, never reading them, where it did not); the round
        then retires the op like any other. A refused call changes nothing."""
        lease = self.live(lease_id)
        if self.adopted is None or not self.ledger.host.num_pages:
            raise ValueError("load_adopted needs device_adopt and a host tier (host_pages > 0)")
        given = list(pages)
        if not given:
            return None
        core = self.core
        ids = core.walk(lease.tokens).ids
        first = core.load_reach(ids)[0]
        pinned = set(lease.host_nodes)
        tail = ids[first : first + len(given)]
        states = core.tier_states(ids[first : first + len(given)])
        ready = [
            host == HostState.VALID and device == DeviceState.NONE and i in pinned
            for (device, host, _), i in zip(states, ids[first:], strict=False)
        ]
        held = ready.index(False) if False in ready else len(tail)
        if held < len(given):
            raise ValueError(
                f"lease {lease_id} holds {held} host-only pages after its {first} device pages; "
                f"cannot load {len(given)}"
            )
        step = self.ledger.page_size * 4
        prefix = core.device_pages(ids[:first])
        left = self.adopt(lease_id, lease.tokens[: (first + len(given)) * step], prefix + given)
        if left:  # cannot happen: every page was off device
            raise RuntimeError(f"load_adopted left pages {left} unadopted")
        self.ledger.stats.loads_issued_pages += len(given)
        return self._issue(lease, OpKind.LOAD, tail, given)

    def drain(self) -> list[int]:
        """Adopted pages freed since the last drain, in the order the core freed them (alike on
        every rank); the engine owns them again. Without ``device_adopt``: none."""
        return self.adopted.drain() if self.adopted is not None else []

    def drop_tree(self) -> list[int]:
        """Dispose of the tree (a reset); returns the adopted pages it held and those freed but not
        drained yet, in page order: the engine gets them back from the next core (``hand_back``)."""
        out: list[int] = []
        if self.adopted is not None:
            out = self.adopted.drain()
            held = self.core.ids_on_device(self.core.ids())
            out.extend(self.core.device_pages(held))
        self.core.dispose()
        return sorted(out)

    def hand_back(self, pages: list[int]) -> None:
        if pages and self.adopted is not None:
            self.adopted.free_all(pages)

    # ------------------------------------------------------------------ copies to engine blocks

    def hit_nodes(self, lease: Lease) -> list[int]:
        """The ids of the leading pages of the lease's tokens that are host-VALID and pinned by the
        lease. Pure."""
        core = self.core
        pinned = set(lease.host_nodes)
        ids = core.walk(lease.tokens).ids
        k = 0
        for (_, host, _), node_id in zip(core.tier_states(ids), ids, strict=True):
            if host != HostState.VALID or node_id not in pinned:
                break
            k += 1
        return ids[:k]

    def save(self, lease: Lease, token_bytes: bytes, blocks: list[int]) -> Transfer | None:
        """Copy the full pages of the tokens the cache lacks from the engine's ``blocks`` into host.

        ``blocks[i]`` holds page i, or is ``NOT_HELD``. Pages from the first one not on host (valid
        or being written) to the last full page, or to the first page not held after it, are saved,
        as many as host slots can be found for (evicting unpinned host pages, least valuable
        first); the rest are skipped, so the host tier stays ancestor-closed.
        Returns the op, or None when nothing needed saving or no slot was free."""
        core = self.core
        walk = core.walk(token_bytes)
        n = walk.num_pages
        if len(blocks) < n:
            raise ValueError(f"save needs an engine block for each of {n} full pages, got {len(blocks)}")
        self.ledger.tick()
        ids = walk.ids
        first = 0
        while first < len(ids) and core.host(ids[first])[0] != HostState.NONE:
            first += 1
        end = first
        while end < n and blocks[end] != NOT_HELD:
            end += 1
        if end == first:
            return None
        parent = ids[first - 1] if first else ROOT
        if first:
            core.update(parent, host_pins=+1)  # eviction for the new slots must not take their parent
        slots = self.evictor.alloc_host_upto(end - first)
        if first:
            core.update(parent, host_pins=-1)
        if not slots:
            return None
        walk = core.walk(token_bytes)  # eviction may have removed nodes past `first`
        ids = walk.ids
        saved: list[int] = []
        for i, slot in zip(range(first, first + len(slots)), slots, strict=True):
            if i < len(ids):
                node_id = ids[i]
                core.update(node_id, host=(HostState.WRITING, slot), stamp=True)
            else:
                node_id = core.add_host_page(parent, walk.pages[i], walk.hashes[i], slot)
            saved.append(node_id)
            parent = node_id
        core.stats.backups_issued_pages += len(saved)
        return self._issue(lease, OpKind.BACKUP, saved, blocks[first : first + len(slots)])

    def load_into(self, lease: Lease, first_page: int, blocks: list[int]) -> Transfer | None:
        """Copy pages ``first_page ..`` of the lease's hit into the engine's ``blocks`` (one per page).

        The pages must be part of the hit (``hit_nodes``); their host slots stay pinned by the lease
        until it is released, which waits for this op. Returns the op (None for no blocks)."""
        if isinstance(first_page, bool) or not isinstance(first_page, int) or first_page < 0:
            raise ValueError(f"first_page must be a non-negative int, got {first_page!r}")
        if NOT_HELD in blocks:
            raise ValueError("a load needs an engine block for every page it copies")
        held = self.hit_nodes(lease)
        if first_page + len(blocks) > len(held):
            last = first_page + len(blocks) - 1
            raise ValueError(f"lease {lease.lease_id} holds {len(held)} pages; cannot load pages {first_page}..{last}")
        if not blocks:
            return None
        self.ledger.tick()
        self.ledger.stats.loads_issued_pages += len(blocks)
        return self._issue(lease, OpKind.LOAD, held[first_page : first_page + len(blocks)], blocks)

    def _issue(self, lease: Lease, kind: OpKind, ids: list[int], blocks: list[int]) -> Transfer:
        op = self.outbox.issue(kind, ids, lease.lease_id, engine_pages=blocks)
        self.leases.wait_for(lease, op.op_id)
        self.leases.refresh(lease)
        return op
