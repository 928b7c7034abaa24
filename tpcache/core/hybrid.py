"""The component side of the sequenced operations of a hybrid model (SWA pages, Mamba states).

``CacheCore`` runs its full-attention logic and calls in here where components change the answer:

- ``match``: the hit is ``hitrule.hit_length`` over what is readable (on device now; on device or
  host once loaded), so ``lock`` pins, and ``load`` brings back, exactly what that hit reads: the
  full pages 1..P, the SWA pages of the window before P, the state at P;
- stamps: full pages along the hit, SWA data only inside the window, a state where the hit ends
  (an SWA page that no request reads any more ages out first);
- ``insert`` adopts the component slots the engine filled (a state only where the configuration
  keeps one), pinned by the lease, then frees the lease's own SWA behind its window: page-aligned,
  keeping ``max(W, page_size)`` tokens at the end (no leaf loses all its SWA) and, with states,
  the window before the path's last state (where a later hit ends), never inside the protected
  prefix (the hit its lock found), never what another lease or a copy holds;
- ``chunk_tokens`` says how large a prefill chunk the pools can take now, shrinking it page by
  page instead of refusing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpcache.core.hitrule import hit_length, keeps_state, window_range
from tpcache.core.records import Lease, LeasePart, MatchResult, OpKind
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore.allocator import OutOfPages
from tpcache.core.treecore.components import DEV, DPINS, DSLOT, HOST, Part, readable_tier

if TYPE_CHECKING:
    from tpcache.core.leases import Leases
    from tpcache.core.outbox import Outbox
    from tpcache.core.treecore import TreeCore
    from tpcache.core.treecore.eviction import Evictor
    from tpcache.core.treecore.part_eviction import PartEvictor

_VALID = int(DeviceState.VALID)
_LOADING = int(DeviceState.LOADING)
_HVALID = int(HostState.VALID)


DEVICE, READABLE, LOADABLE = range(3)  # what counts as available to the hit rule


class _Available(Sequence[bool]):
    """Per page, computed only where the hit rule looks: is this component's data available?
    DEVICE: valid on device; READABLE: valid on device or host; LOADABLE (for a load): on device
    (valid, or loading: the load waits for it) or valid on host above ``before``."""

    def __init__(self, core: TreeCore, ids: list[int], base: int, mode: int, before: int = 0) -> None:
        self.core, self.ids, self.base, self.mode, self.before = core, ids, base, mode, before

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        rec = self.core.component(self.ids[i])
        assert rec is not None
        if self.mode == LOADABLE:
            return rec[self.base + DEV] != 0 or (i < self.before and rec[self.base + HOST] == _HVALID)
        tier = readable_tier(rec, self.base)
        return tier == 1 if self.mode == DEVICE else tier != 0


@dataclass
class LoadPlan:
    pages: int  # the hit P the load serves
    needs: list[tuple[Part, int]] = field(default_factory=list)  # component data the hit reads (node ids)
    loads: list[tuple[Part, int]] = field(default_factory=list)  # of those, what comes from host


class Hybrid:
    def __init__(self, core: TreeCore, book: Leases, outbox: Outbox, evictor: Evictor, parts: PartEvictor) -> None:
        self.core = core
        self.ledger = ledger = core.ledger  # pools, counters and components' queues (no node is read through it)
        self.book = book
        self.outbox = outbox
        self.evictor = evictor
        self.part_evictor = parts
        self.parts = ledger.parts
        self.window_part = next((p for p in self.parts.values() if p.spec.is_window), None)
        self.state_part = next((p for p in self.parts.values() if p.spec.every), None)
        self.window = self.window_part.spec.window_pages if self.window_part else 0
        cfg = ledger.config
        self.trim = self.window_part is not None and cfg.swa_release_out_of_window

    # ------------------------------------------------------------------ the hit

    def _comp(self, node_id: int) -> tuple[int, ...]:
        """The node's component record (it has one: the configuration has components)."""
        rec = self.core.component(node_id)
        assert rec is not None
        return rec

    def hit(self, ids: list[int], full: int, mode: int = READABLE, before: int = 0) -> int:
        w, s = self.window_part, self.state_part
        swa = _Available(self.core, ids, w.base, mode, before) if w else None
        state = _Available(self.core, ids, s.base, mode, before) if s else None
        return hit_length(full, self.window, swa, state)

    def needs(self, nodes: list[int], p: int) -> list[tuple[Part, int]]:
        """The component data a hit of ``p`` pages of the path ``nodes`` (ids) reads, in path order per component."""
        out: list[tuple[Part, int]] = []
        if self.window_part is not None:
            out += [(self.window_part, nodes[i]) for i in window_range(p, self.window)]
        if self.state_part is not None and p:
            out.append((self.state_part, nodes[p - 1]))
        return out

    def match(self, result: MatchResult, full_device: int, full_any: int) -> None:
        """Cut a full-attention match to the hybrid hit (pure)."""
        nodes = result.walk.ids
        p = self.hit(nodes, full_any)
        dev = self.hit(nodes, min(full_device, p), DEVICE)
        result.device_pages, result.host_pages = dev, p - dev
        if dev < full_device:
            result.device_page_array = result.device_page_array[:dev]
        result.nodes = nodes[:p]
        for part, node in self.needs(nodes, p):
            result.parts.setdefault(part.index, []).append(node)

    def device_run(self, result: MatchResult) -> int:
        """Leading nodes of the hit whose full page is device-valid (pinned on device by ``lock``)."""
        n = result.device_pages
        states = self.core.tier_states(result.nodes[n:])
        for device_state, _, _ in states:
            if device_state != DeviceState.VALID:
                break
            n += 1
        return n

    def pin_hit(self, lease: Lease, result: MatchResult) -> None:
        """Pin and stamp, for ``lock``, the component data its hit reads, on the tier it is read from."""
        core = self.core
        lease.hit_pages = len(result.nodes)
        for c, nodes in result.parts.items():
            held = self.held(lease, c)
            for node_id in nodes:
                if readable_tier(self._comp(node_id), self.parts[c].base) == 1:  # type: ignore[arg-type]
                    core.update(node_id, part=c, device_pins=+1, stamp=True)
                    held.device_nodes.append(node_id)
                    self.parts[c].behind.pop(node_id, None)  # a window again: no longer behind
                else:
                    core.update(node_id, part=c, host_pins=+1, stamp=True)
                    held.host_nodes.append(node_id)

    @staticmethod
    def held(lease: Lease, c: int) -> LeasePart:
        held = lease.parts.get(c)
        if held is None:
            held = lease.parts[c] = LeasePart()
        return held

    # ------------------------------------------------------------------ load

    def plan_load(self, nodes: list[int], full: int, first_loading: int) -> LoadPlan:
        """The hit a load serves: full pages on device or loadable, component data on device or loadable
        (not at or below a page another request is loading: see ``loads``)."""
        before = first_loading if first_loading >= 0 else len(nodes)
        p = self.hit(nodes, full, LOADABLE, before)
        plan = LoadPlan(p, self.needs(nodes, p))
        plan.loads = [(part, n) for part, n in plan.needs if not self._comp(n)[part.base + DEV]]
        return plan

    def reserve(self, lease: Lease, plan: LoadPlan, full_pages: int) -> dict[int, list[int]]:
        """Pin the component data already on device, check every pool, then allocate the component
        slots. Refuses (nothing evicted, nothing pinned) when a component pool cannot be met; returns
        nothing when the full pool cannot, whose allocation then refuses."""
        core = self.core
        pinned: list[tuple[Part, int]] = []
        for part, node_id in plan.needs:
            if self._comp(node_id)[part.base + DEV]:
                core.update(node_id, part=part.index, device_pins=+1, stamp=True)
                self.held(lease, part.index).device_nodes.append(node_id)
                part.behind.pop(node_id, None)
                pinned.append((part, node_id))
        need: dict[int, int] = {}
        for part, _ in plan.loads:
            need[part.index] = need.get(part.index, 0) + 1
        short = [self.parts[c] for c, n in need.items() if not self.part_evictor.can_alloc_device(self.parts[c], n)]
        if short or not self.evictor.can_alloc_device(full_pages):
            for part, node_id in reversed(pinned):
                core.update(node_id, part=part.index, device_pins=-1)
                self.held(lease, part.index).device_nodes.remove(node_id)
            if short:
                p = short[0]
                raise OutOfPages(
                    f"{p.name} device pool: need {need[p.index]} slots, {p.device.available} free "
                    f"and {p.evictable} evictable"
                )
            return {}
        return {c: self.part_evictor.alloc_device(self.parts[c], n) for c, n in need.items()}

    def start_loads(
        self, lease: Lease, plan: LoadPlan, todo: list[int], slots: dict[int, list[int]]
    ) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """Mark the component loads, wait for component loads others started, and lay out the op:
        its nodes in path order, the positions moving a full page, and per component those moving it."""
        core, led = self.core, self.ledger
        for part, node_id in plan.needs:
            if self._comp(node_id)[part.base + DEV] == _LOADING:
                for op in self.outbox.inflight[OpKind.LOAD]:
                    if op.op_id not in lease.ops and any(
                        pc.part == part.index and any(op.nodes[i] == node_id for i in pc.index) for pc in op.parts
                    ):
                        self.book.wait_for(lease, op.op_id)
        taken = {c: iter(s) for c, s in slots.items()}
        for part, node_id in plan.loads:
            slot = next(taken[part.index])
            core.update(node_id, part=part.index, device=(DeviceState.LOADING, slot), device_pins=+1, host_pins=+1)
            self.held(lease, part.index).device_nodes.append(node_id)
        led.stats.part_loads_issued += len(plan.loads)
        todo_ids, load_ids = todo, [n for _, n in plan.loads]
        moved = dict.fromkeys(todo_ids + load_ids)
        depth = dict(zip(moved, core.depths(moved), strict=True))
        order_ids = sorted(moved, key=depth.__getitem__)  # path order
        at = {node_id: i for i, node_id in enumerate(order_ids)}
        full_index = [at[i] for i in todo_ids]
        parts: dict[int, list[int]] = {}
        for (part, _), node_id in zip(plan.loads, load_ids, strict=True):
            parts.setdefault(part.index, []).append(at[node_id])
        return order_ids, full_index, parts

    # ------------------------------------------------------------------ insert

    def check_insert(self, lease: Lease, nodes: list[int | None], parts: Mapping[int, Sequence[int]]) -> None:
        """Validate the component slots of an insert before anything changes (a refused insert
        changes nothing): each is held by the lease, or is already the node's own."""
        for c, slots in parts.items():
            if c not in self.parts:
                raise ValueError(f"no component {c} in this configuration")
            owned = set(self.held(lease, c).pages)
            base = self.parts[c].base
            for i, slot in enumerate(slots[: len(nodes)]):
                node_id = nodes[i]
                rec = None if node_id is None else self.core.component(node_id)
                if slot < 0 or (rec is not None and rec[base + DSLOT] == slot):
                    continue
                if slot not in owned:
                    raise ValueError(f"{self.parts[c].name} slot {slot} is not held by lease {lease.lease_id}")
                owned.discard(slot)

    def adopt(self, lease: Lease, path: list[int], parts: Mapping[int, Sequence[int]], last: int) -> list[int]:
        """Take the component slots the engine filled for nodes on ``path`` (ids) that lack that
        component (a state only where kept); pinned by the lease. Returns the nodes that gained data."""
        core = self.core
        gained: list[int] = []
        for c, slots in parts.items():
            part = self.parts[c]
            held = self.held(lease, c)
            for i, slot in enumerate(slots[: len(path)]):
                node_id = path[i]
                if slot < 0 or core.device(node_id)[0] != DeviceState.VALID or self._comp(node_id)[part.base + DEV]:
                    continue  # nothing given, no full page to go with it, or the node has its own
                if slot not in held.pages:
                    continue
                if part.spec.every and not keeps_state(part.spec.every, i, last):
                    continue  # a state where none is kept: it stays with the lease
                held.pages.remove(slot)
                core.update(node_id, part=c, device=(DeviceState.VALID, slot), device_pins=+1, stamp=True)
                held.device_nodes.append(node_id)
                gained.append(node_id)
        return gained

    def release_out_of_window(self, lease: Lease, path: list[int]) -> None:
        """Let go of the lease's own SWA data behind its window (see the module docstring); it is freed
        now, or by the first commit after the copies still reading it land (a backup keeps it on host)."""
        part = self.window_part
        if not self.trim or part is None:
            return
        held = self.held(lease, part.index)
        # ``window`` pages (ceil(W / page_size), so at least max(W, page_size) tokens) before the
        # path's end, or before its last state when states are kept only every k pages
        end = self._last_state(path) - self.window
        core = self.core
        behind = set(path[lease.hit_pages : max(lease.hit_pages, end)])
        if not behind:
            return
        kept: list[int] = []
        for node_id in held.device_nodes:
            if node_id not in behind:
                kept.append(node_id)
                continue
            core.update(node_id, part=part.index, device_pins=-1)
            part.behind[node_id] = node_id
        held.device_nodes = kept
        self.free_behind()

    def _last_state(self, path: list[int]) -> int:
        """The deepest page count on ``path`` a hit could end at: its last node with a state (valid
        or loading), or the whole path without a state component. The window before it is kept."""
        part = self.state_part
        if part is None:
            return len(path)
        dev = part.base + DEV
        for q in range(len(path), 0, -1):
            if self._comp(path[q - 1])[dev]:
                return q
        return len(path)

    def free_behind(self) -> None:
        """Free the SWA data behind windows that nothing reads any more (after an insert, and once
        per commit, when the backups that read it have landed)."""
        part = self.window_part
        if part is None or not part.behind:
            return
        core = self.core
        b = part.base
        for node_id in list(part.behind):
            rec = core.component(node_id) if core.exists(node_id) else None
            if rec is None or rec[b + DEV] != _VALID:
                del part.behind[node_id]  # gone meanwhile (evicted, or its full page left)
            elif not rec[b + DPINS]:
                del part.behind[node_id]
                core.free_part_device(node_id, part.index)
                core.stats.swa_released_pages += 1

    # ------------------------------------------------------------------ queries (pure)

    def chunk_tokens(self, lease: Lease, start: int, want: int) -> int:
        """The page-aligned tokens of a prefill chunk starting at token ``start`` that every pool can
        take now (the whole ``want`` when it fits). Counts only what allocation could free: never the
        lease's reserved window or protected prefix (pinned), and holds back the SWA slots its host
        hit still needs to load."""
        ps = self.ledger.page_size
        pages = -(-want // ps)
        first = start // ps
        room = self.ledger.device.available + self.ledger.evictable_device_pages
        pages = min(pages, room)
        for part in self.parts.values():
            free = part.device.available + part.evictable
            if part.spec.is_window:
                free -= self._host_window(lease, part)
                pages = min(pages, max(0, free))
            else:
                while pages and self._states(part, first, pages) > free:
                    pages -= 1
        return want if pages * ps >= want else pages * ps

    def _host_window(self, lease: Lease, part: Part) -> int:
        """SWA pages of the lease's hit that are only on host: its load still needs device slots."""
        held = lease.parts.get(part.index)
        if held is None:
            return 0
        return sum(1 for n in held.host_nodes if not self._comp(n)[part.base + DEV])

    @staticmethod
    def _states(part: Part, first: int, pages: int) -> int:
        every = part.spec.every
        if every > 0:
            return (first + pages) // every - first // every
        return 1

    def part_slots(self, lease: Lease) -> dict[int, list[tuple[int, int]]]:
        """Per component, (page index, device slot) of what the lease holds on device, in page order."""
        core = self.core
        out: dict[int, list[tuple[int, int]]] = {}
        for c, held in lease.parts.items():
            base = self.parts[c].base
            ids = held.device_nodes
            slots = [self._comp(n)[base + DSLOT] for n in ids]
            out[c] = sorted((d - 1, slot) for d, slot in zip(core.depths(ids), slots, strict=True))
        return out
