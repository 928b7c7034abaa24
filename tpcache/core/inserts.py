"""Insert: adopting the KV an engine wrote into a lease's pages as cached pages of the tree.

Invariants:
- a refused insert changes nothing (everything is validated before the first change);
- nothing is inserted below a page still loading (if its load fails the page goes, and a device
  child would hang from nothing);
- the lease pins its whole device path, so nothing it holds has an evictable-looking ancestor;
- with components, the engine's component slots are adopted where the node lacks that data (a
  state only where the configuration keeps one), then the lease's SWA behind its window is freed
  (``hybrid``), after the write policy started the backups that keep a host copy of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.records import Lease, NoCursor
from tpcache.core.tiers import DeviceState
from tpcache.core.treecore.core import ROOT
from tpcache.core.treecore.tree import Walk

if TYPE_CHECKING:
    from tpcache.core.backup import Backup
    from tpcache.core.hybrid import Hybrid
    from tpcache.core.leases import Leases
    from tpcache.core.treecore import TreeCore

_VALID = DeviceState.VALID


class Inserter:
    def __init__(self, core: TreeCore, book: Leases, backup: Backup, hybrid: Hybrid | None) -> None:
        self.core = core
        self.ledger = core.ledger  # the clock, counters and new chains (no node is read through it)
        self.book = book
        self.backup = backup
        self.hybrid = hybrid

    def insert(
        self, lease: Lease, tokens: TokenIds, pages: list[int], parts: Mapping[int, Sequence[int]] | None = None
    ) -> tuple[int, int]:
        """Adopt the KV the engine wrote into ``pages`` for the full pages of ``tokens``.

        ``pages[i]`` holds page i of the tokens; it is either the cached node's own page or a page
        of this lease. Pages already cached are duplicates and go back to the lease. Nothing is
        inserted below a page still loading (if its load fails the page goes, and a device child
        would hang from nothing). New nodes are pinned by the lease until it is released.
        ``parts``: per component, the slot holding page i's data (-1: none), see ``hybrid.adopt``.
        The lease's SWA slots behind its window are freed by the insert (``part_slots`` lists what
        it still holds): a later insert passes -1 for those pages, and the engine writes them no more.
        Returns (inserted pages, duplicate pages)."""
        data = as_token_bytes(tokens)
        plain = not parts and self.hybrid is None
        kept = self._lock_walk(lease, data) if plain else None
        walk = self.ledger.tree.walk(data) if kept is None else kept
        if plain and (made := self._insert_pinned(lease, walk, pages)) is not None:
            return made
        if kept is not None:  # the lock's walk serves ``_insert_pinned`` only: ``_adopt`` walks the tree as it is
            walk = self.ledger.tree.walk(data)
        return self._adopt(lease, walk, None, pages, parts)

    def _lock_walk(self, lease: Lease, data: bytes) -> Walk | None:
        """The walk the lease's lock made of these very bytes (used once), if nothing was added since
        below its last node for the next page. Only ``_insert_pinned`` takes it: that the lease still
        pins exactly its nodes, and so that they are in the tree, it checks itself."""
        walk, lease.walk = lease.walk, None
        if walk is None or data is not lease.tokens:
            return None
        ids = walk.ids
        k = len(ids)
        if k < walk.num_pages and self.core.has_child(ids[-1] if k else ROOT, data, k * walk.step):
            return None
        return walk

    def append(
        self, lease: Lease, tokens: TokenIds, pages: list[int], parts: Mapping[int, Sequence[int]] | None = None
    ) -> tuple[int, int]:
        """``insert`` of the full pages of ``tokens`` that follow the sequence the lease's last insert
        or append adopted (its cursor); ``pages[i]`` and ``parts[c][i]`` are those of page i of
        ``tokens``. Costs what it adds: no walk from the root and no pass over the lease's path.

        The lease has a cursor after an insert or append that adopted its whole sequence and left
        the lease pinning exactly that path; a load, a prefetch's pins or a failed load clears it, and
        so does an append stopped by a page still loading. Without one: ``NoCursor``."""
        cursor = lease.cursor
        if cursor is None:
            raise NoCursor(f"lease {lease.lease_id} has no sequence to continue: insert the whole sequence")
        if self.hybrid is not None:  # components index pages from the root: insert the whole path
            core = self.core
            path = core.path_of(cursor)
            before = core.path_tokens(path[-1]) if path else b""
            padded = {c: [-1] * len(path) + list(v) for c, v in parts.items()} if parts else None
            return self.insert(lease, before + as_token_bytes(tokens), core.device_pages(path) + pages, padded)
        data = as_token_bytes(tokens)
        if not parts:  # most appends: ``_append_new``, in C where built (_chain.c; None where it does not apply)
            chain = self.core.append_chain(lease, cursor, data, pages)
            if chain is not None:
                return self._added(lease, chain)
            if (made := self._append_new(lease, cursor, data, pages)) is not None:
                return made
        return self._adopt(lease, self.core.walk(data, cursor), cursor, pages, parts)

    def _append_new(self, lease: Lease, cursor: int, data: bytes, pages: list[int]) -> tuple[int, int] | None:
        """``_adopt`` below the cursor when every page is new and the lease holds each of ``pages``
        (a running request's next pages, most appends): the same changes without the walk and the
        plan. None, changing nothing, for any other append (``_adopt`` handles it, or refuses it)."""
        led = self.ledger
        step = led.page_size * 4
        n = len(data) // step
        held = lease.pages
        if not n or len(pages) < n or len(held) < n or self.core.has_child(cursor, data, 0):
            return None
        new = pages[:n]  # a copy: ``pages`` may be the lease's own holding, which the adoption empties
        fresh = set(new)
        if len(fresh) != n or not fresh.issubset(held):
            return None
        depth = self.core.depths((cursor,))[0]
        return self._add_new(lease, cursor, depth, data, 0, new, fresh)

    def _insert_pinned(self, lease: Lease, walk: Walk, pages: list[int]) -> tuple[int, int] | None:
        """``_adopt`` from the root when the lease pins exactly the walk's nodes on device, each valid
        on the page given for it, and holds each page past them (a lock's own sequence inserted back
        with its new pages, most inserts): the same changes without the passes over the path. None,
        changing nothing, for any other insert.

        The lease pins whole paths on device (``leases``), so pinning as many nodes as the walk
        matched, one of them its last, is pinning exactly the walk's nodes."""
        nodes, held = walk.ids, lease.device_nodes
        k, n = len(nodes), walk.num_pages
        if len(held) != k or len(pages) < n or lease.host_nodes or (k and held[-1] != nodes[-1]):
            return None
        if k and not self.core.valid_on_device(nodes[-1]):  # VALID pages have VALID ancestors
            return None
        # The pages the lock's match read stay the nodes' own while the lease pins them.
        ids = walk.matched_pages if walk.matched_pages is not None else walk.device_page_ids(k)
        try:  # compared as int32 arrays: no int object made per page
            if ids != array(ids.typecode, pages[:k]):
                return None
        except (TypeError, OverflowError):  # a page that is no int32 is none of the nodes' pages
            return None
        new, held = pages[k:n], lease.pages
        fresh = None  # most hold just these: distinct, as every page has one owner (invariants.check)
        if held != new:
            fresh = set(new)
            if len(fresh) != len(new) or not fresh.issubset(held):
                return None
        last = nodes[-1] if nodes else ROOT
        return self._add_new(lease, last, k, walk.token_bytes, k * walk.step, new, fresh)  # a walk from the root

    def _add_new(
        self, lease: Lease, parent: int, depth: int, data: bytes, offset: int, new: list[int], fresh: set[int] | None
    ) -> tuple[int, int]:
        """The new pinned chain of ``new`` below ``parent`` (``depth`` pages from the root; the lease
        pins its path and holds ``new``, ``fresh`` as a set, or None when it holds exactly ``new``;
        none: the lease may continue from ``parent``): what ``_adopt`` does for pages the tree lacks."""
        led, held, n = self.ledger, lease.pages, len(new)
        led.tick()
        if len(held) == n:  # it held just these (pages are distinct): all now in the tree
            held.empty()
        else:
            held.discard(fresh if fresh is not None else set(new))
        chain = self.core.add_pinned_chain(parent, data, offset, new) if new else []
        lease.device_nodes.extend(chain)
        lease.cursor = (chain[-1] if chain else parent) if len(lease.device_nodes) == depth + n else None
        return self._added(lease, chain)

    def _added(self, lease: Lease, chain: list[int]) -> tuple[int, int]:
        self.backup.on_insert(chain)
        self.book.refresh(lease)
        self.ledger.stats.inserted_pages += len(chain)
        return len(chain), 0

    def _adopt(
        self,
        lease: Lease,
        walk: Walk,
        start: int | None,
        pages: list[int],
        parts: Mapping[int, Sequence[int]] | None,
    ) -> tuple[int, int]:
        """Adopt the walk's pages below ``start`` (None: the root, and ``walk`` covers the whole
        sequence; a node id: the lease's cursor, which the lease pins with its whole path)."""
        lease_id = lease.lease_id
        if len(pages) < walk.num_pages:
            raise ValueError(f"insert needs a device page for each of {walk.num_pages} full pages")
        if parts and self.hybrid is None:
            raise ValueError("component slots given to a configuration without components")
        # Validate everything before mutating anything: a refused insert changes nothing.
        core = self.core
        owned = set(lease.pages)
        ids = walk.ids  # the nodes the walk found
        sides = core.device_sides(ids)  # (device state, device page) of each, in one pass
        plan: list[tuple[int, int]] = []  # (index of an existing node off device, page) to adopt
        duplicates = 0
        loading = False
        for i, (state, own) in enumerate(sides):
            if state == DeviceState.LOADING:
                loading = True
                break
            page = pages[i]
            if state:  # on device
                if page != own:
                    if page not in owned:
                        raise ValueError(f"page {page} is neither cached here nor held by lease {lease_id}")
                    duplicates += 1
                continue
            if page not in owned:
                raise ValueError(f"page {page} is not held by lease {lease_id}")
            owned.discard(page)
            plan.append((i, page))
        # The pages past the walk become new nodes, each below the one before.
        new = [] if loading else pages[len(ids) : walk.num_pages]
        if not owned.issuperset(new) or len(set(new)) != len(new):
            for page in new:  # name the first page that is not the lease's to give
                if page not in owned:
                    raise ValueError(f"page {page} is not held by lease {lease_id}")
                owned.discard(page)
        if parts:
            self.hybrid.check_insert(lease, [*ids, *[None] * (walk.num_pages - len(ids))], parts)  # type: ignore[union-attr]
        led = self.ledger
        led.tick()
        top = ROOT if start is None else start
        taken = {page for _, page in plan}
        taken.update(new)
        lease.pages.discard(taken)  # now in the tree
        inserted: list[int] = []
        for i, page in plan:  # pages the tree has, off device
            core.update(ids[i], device=(DeviceState.VALID, page), stamp=True, device_pins=1)
            sides[i] = (_VALID, page)
            inserted.append(ids[i])
        chain: list[int] = []
        if new:  # stamped as made
            chain = core.add_pinned_chain(ids[-1] if ids else top, walk.token_bytes, len(ids) * walk.step, new)
            inserted.extend(chain)
        # The lease pins its whole device path, so nothing it holds has an evictable-looking ancestor.
        # Only what it did not pin yet is touched (and stamped): the rest was stamped when the lease
        # pinned it and is stamped again when the lease lets it go, so an insert costs what it adds.
        # Below a cursor the lease pins nothing, so an append needs no look at what it holds.
        pinned = set(lease.device_nodes) if start is None else ()
        fresh = {i for i, _ in plan}
        pins: list[int] = []
        for i, node_id in enumerate(ids):
            if i in fresh:
                pins.append(node_id)
            elif sides[i][0] and node_id not in pinned:
                core.update(node_id, stamp=True, device_pins=1)
                pins.append(node_id)
        pins.extend(chain)
        lease.device_nodes.extend(pins)
        # ``append`` may continue from here when the whole sequence is adopted and the lease pins
        # exactly its path (a lock of other tokens, or a stop at a loading page, leaves none).
        length = len(ids) + len(chain)
        whole = length == walk.num_pages and all(state == _VALID for state, _ in sides)
        depth = (0 if start is None else core.depths((start,))[0]) + length
        last = chain[-1] if chain else ids[-1] if ids else top
        lease.cursor = last if whole and len(lease.device_nodes) == depth else None
        if self.hybrid is not None:
            on_device = [n for n, (state, _) in zip(ids, sides, strict=True) if state == _VALID] + chain
            gained = self.hybrid.adopt(lease, on_device, parts or {}, walk.num_pages - 1)
            inserted_ids = set(inserted)
            self.backup.on_insert(inserted + [i for i in gained if i not in inserted_ids])
            self.hybrid.release_out_of_window(lease, on_device)
        else:
            self.backup.on_insert(inserted)
        self.book.refresh(lease)
        led.stats.inserted_pages += len(inserted)
        led.stats.duplicate_pages += duplicates
        return len(inserted), duplicates
