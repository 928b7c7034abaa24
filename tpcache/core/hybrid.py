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
    from tpcache.core.treecore.eviction import Evictor
    from tpcache.core.treecore.ledger import Ledger
    from tpcache.core.treecore.part_eviction import PartEvictor
    from tpcache.core.treecore.tree import Node

_VALID = int(DeviceState.VALID)
_LOADING = int(DeviceState.LOADING)
_HVALID = int(HostState.VALID)


DEVICE, READABLE, LOADABLE = range(3)  # what counts as available to the hit rule


class _Available(Sequence[bool]):
    """Per page, computed only where the hit rule looks: is this component's data available?
    DEVICE: valid on device; READABLE: valid on device or host; LOADABLE (for a load): on device
    (valid, or loading: the load waits for it) or valid on host above ``before``."""

    def __init__(self, nodes: list[Node], base: int, mode: int, before: int = 0) -> None:
        self.nodes, self.base, self.mode, self.before = nodes, base, mode, before

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        rec = self.nodes[i].comp
        assert rec is not None
        if self.mode == LOADABLE:
            return rec[self.base + DEV] != 0 or (i < self.before and rec[self.base + HOST] == _HVALID)
        tier = readable_tier(rec, self.base)
        return tier == 1 if self.mode == DEVICE else tier != 0


@dataclass
class LoadPlan:
    pages: int  # the hit P the load serves
    needs: list[tuple[Part, Node]] = field(default_factory=list)  # component data the hit reads
    loads: list[tuple[Part, Node]] = field(default_factory=list)  # of those, what comes from host


class Hybrid:
    def __init__(self, ledger: Ledger, book: Leases, outbox: Outbox, evictor: Evictor, parts: PartEvictor) -> None:
        self.ledger = ledger
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

    def hit(self, nodes: list[Node], full: int, mode: int = READABLE, before: int = 0) -> int:
        w, s = self.window_part, self.state_part
        swa = _Available(nodes, w.base, mode, before) if w else None
        state = _Available(nodes, s.base, mode, before) if s else None
        return hit_length(full, self.window, swa, state)

    def needs(self, nodes: list[Node], p: int) -> list[tuple[Part, Node]]:
        """The component data a hit of ``p`` pages reads, in path order per component."""
        out: list[tuple[Part, Node]] = []
        if self.window_part is not None:
            out += [(self.window_part, nodes[i]) for i in window_range(p, self.window)]
        if self.state_part is not None and p:
            out.append((self.state_part, nodes[p - 1]))
        return out

    def match(self, result: MatchResult, full_device: int, full_any: int) -> None:
        """Cut a full-attention match to the hybrid hit (pure)."""
        nodes = result.walk.nodes
        p = self.hit(nodes, full_any)
        dev = self.hit(nodes, min(full_device, p), DEVICE)
        result.device_pages, result.host_pages = dev, p - dev
        if dev < full_device:
            result.device_page_array = result.device_page_array[:dev]
        result.nodes = nodes[:p]
        for part, node in self.needs(nodes, p):
            result.parts.setdefault(part.index, []).append(node)

    @staticmethod
    def device_run(result: MatchResult) -> int:
        """Leading nodes of the hit whose full page is device-valid (pinned on device by ``lock``)."""
        n = result.device_pages
        nodes = result.nodes
        while n < len(nodes) and nodes[n].device_state == DeviceState.VALID:
            n += 1
        return n

    def pin_hit(self, lease: Lease, result: MatchResult) -> None:
        """Pin and stamp, for ``lock``, the component data its hit reads, on the tier it is read from."""
        led = self.ledger
        lease.hit_pages = len(result.nodes)
        for c, nodes in result.parts.items():
            held = self.held(lease, c)
            for node in nodes:
                assert node.comp is not None
                if readable_tier(node.comp, self.parts[c].base) == 1:
                    led.update(node, part=c, device_pins=+1, stamp=True)
                    held.device_nodes.append(node)
                    self.parts[c].behind.pop(node.node_id, None)  # a window again: no longer behind
                else:
                    led.update(node, part=c, host_pins=+1, stamp=True)
                    held.host_nodes.append(node)

    @staticmethod
    def held(lease: Lease, c: int) -> LeasePart:
        held = lease.parts.get(c)
        if held is None:
            held = lease.parts[c] = LeasePart()
        return held

    # ------------------------------------------------------------------ load

    def plan_load(self, nodes: list[Node], full: int, first_loading: int) -> LoadPlan:
        """The hit a load serves: full pages on device or loadable, component data on device or loadable
        (not at or below a page another request is loading: see ``loads``)."""
        before = first_loading if first_loading >= 0 else len(nodes)
        p = self.hit(nodes, full, LOADABLE, before)
        plan = LoadPlan(p, self.needs(nodes, p))
        plan.loads = [(part, n) for part, n in plan.needs if not n.comp[part.base + DEV]]  # type: ignore[index]
        return plan

    def reserve(self, lease: Lease, plan: LoadPlan, full_pages: int) -> dict[int, list[int]]:
        """Pin the component data already on device, check every pool, then allocate the component
        slots. Refuses (nothing evicted, nothing pinned) when a component pool cannot be met; returns
        nothing when the full pool cannot, whose allocation then refuses."""
        led = self.ledger
        pinned: list[tuple[Part, Node]] = []
        for part, node in plan.needs:
            if node.comp[part.base + DEV]:  # type: ignore[index]
                led.update(node, part=part.index, device_pins=+1, stamp=True)
                self.held(lease, part.index).device_nodes.append(node)
                part.behind.pop(node.node_id, None)
                pinned.append((part, node))
        need: dict[int, int] = {}
        for part, _ in plan.loads:
            need[part.index] = need.get(part.index, 0) + 1
        short = [self.parts[c] for c, n in need.items() if not self.part_evictor.can_alloc_device(self.parts[c], n)]
        if short or not self.evictor.can_alloc_device(full_pages):
            for part, node in reversed(pinned):
                led.update(node, part=part.index, device_pins=-1)
                self.held(lease, part.index).device_nodes.remove(node)
            if short:
                p = short[0]
                raise OutOfPages(
                    f"{p.name} device pool: need {need[p.index]} slots, {p.device.available} free "
                    f"and {p.evictable} evictable"
                )
            return {}
        return {c: self.part_evictor.alloc_device(self.parts[c], n) for c, n in need.items()}

    def start_loads(
        self, lease: Lease, plan: LoadPlan, todo: list[Node], slots: dict[int, list[int]]
    ) -> tuple[list[Node], list[int], dict[int, list[int]]]:
        """Mark the component loads, wait for component loads others started, and lay out the op:
        its nodes in path order, the positions moving a full page, and per component those moving it."""
        led = self.ledger
        for part, node in plan.needs:
            if node.comp[part.base + DEV] == _LOADING:  # type: ignore[index]
                for op in self.outbox.inflight[OpKind.LOAD]:
                    if op.op_id not in lease.ops and any(
                        pc.part == part.index and any(op.nodes[i] is node for i in pc.index) for pc in op.parts
                    ):
                        self.book.wait_for(lease, op.op_id)
        taken = {c: iter(s) for c, s in slots.items()}
        for part, node in plan.loads:
            slot = next(taken[part.index])
            led.update(node, part=part.index, device=(DeviceState.LOADING, slot), device_pins=+1, host_pins=+1)
            self.held(lease, part.index).device_nodes.append(node)
        led.stats.part_loads_issued += len(plan.loads)
        order = sorted({n.node_id: n for n in todo + [n for _, n in plan.loads]}.values(), key=lambda n: n.depth)
        at = {n.node_id: i for i, n in enumerate(order)}
        full_index = [at[n.node_id] for n in todo]
        parts: dict[int, list[int]] = {}
        for part, node in plan.loads:
            parts.setdefault(part.index, []).append(at[node.node_id])
        return order, full_index, parts

    # ------------------------------------------------------------------ insert

    def check_insert(self, lease: Lease, nodes: list[Node | None], parts: Mapping[int, Sequence[int]]) -> None:
        """Validate the component slots of an insert before anything changes (a refused insert
        changes nothing): each is held by the lease, or is already the node's own."""
        for c, slots in parts.items():
            if c not in self.parts:
                raise ValueError(f"no component {c} in this configuration")
            owned = set(self.held(lease, c).pages)
            base = self.parts[c].base
            for i, slot in enumerate(slots[: len(nodes)]):
                node = nodes[i]
                if slot < 0 or (node is not None and node.comp is not None and node.comp[base + DSLOT] == slot):
                    continue
                if slot not in owned:
                    raise ValueError(f"{self.parts[c].name} slot {slot} is not held by lease {lease.lease_id}")
                owned.discard(slot)

    def adopt(self, lease: Lease, path: list[Node], parts: Mapping[int, Sequence[int]], last: int) -> list[Node]:
        """Take the component slots the engine filled for nodes on ``path`` that lack that component
        (a state only where kept); pinned by the lease. Returns the nodes that gained data."""
        led = self.ledger
        gained: list[Node] = []
        for c, slots in parts.items():
            part = self.parts[c]
            held = self.held(lease, c)
            for i, slot in enumerate(slots[: len(path)]):
                node = path[i]
                if slot < 0 or node.device_state != DeviceState.VALID or node.comp[part.base + DEV]:  # type: ignore[index]
                    continue  # nothing given, no full page to go with it, or the node has its own
                if slot not in held.pages:
                    continue
                if part.spec.every and not keeps_state(part.spec.every, i, last):
                    continue  # a state where none is kept: it stays with the lease
                held.pages.remove(slot)
                led.update(node, part=c, device=(DeviceState.VALID, slot), device_pins=+1, stamp=True)
                held.device_nodes.append(node)
                gained.append(node)
        return gained

    def release_out_of_window(self, lease: Lease, path: list[Node]) -> None:
        """Let go of the lease's own SWA data behind its window (see the module docstring); it is freed
        now, or by the first commit after the copies still reading it land (a backup keeps it on host)."""
        part = self.window_part
        if not self.trim or part is None:
            return
        held = self.held(lease, part.index)
        # ``window`` pages (ceil(W / page_size), so at least max(W, page_size) tokens) before the
        # path's end, or before its last state when states are kept only every k pages
        end = self._last_state(path) - self.window
        behind = {n.node_id for n in path[lease.hit_pages : max(lease.hit_pages, end)]}
        if not behind:
            return
        led = self.ledger
        kept: list[Node] = []
        for node in held.device_nodes:
            if node.node_id not in behind:
                kept.append(node)
                continue
            led.update(node, part=part.index, device_pins=-1)
            part.behind[node.node_id] = node
        held.device_nodes = kept
        self.free_behind()

    def _last_state(self, path: list[Node]) -> int:
        """The deepest page count on ``path`` a hit could end at: its last node with a state (valid
        or loading), or the whole path without a state component. The window before it is kept."""
        part = self.state_part
        if part is None:
            return len(path)
        dev = part.base + DEV
        for q in range(len(path), 0, -1):
            if path[q - 1].comp[dev]:  # type: ignore[index]
                return q
        return len(path)

    def free_behind(self) -> None:
        """Free the SWA data behind windows that nothing reads any more (after an insert, and once
        per commit, when the backups that read it have landed)."""
        part = self.window_part
        if part is None or not part.behind:
            return
        led = self.ledger
        b = part.base
        for node_id, node in list(part.behind.items()):
            rec = node.comp
            if rec is None or rec[b + DEV] != _VALID:
                del part.behind[node_id]  # gone meanwhile (evicted, or its full page left)
            elif not rec[b + DPINS]:
                del part.behind[node_id]
                led.free_part_device(node, part)
                led.stats.swa_released_pages += 1

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

    @staticmethod
    def _host_window(lease: Lease, part: Part) -> int:
        """SWA pages of the lease's hit that are only on host: its load still needs device slots."""
        held = lease.parts.get(part.index)
        return sum(1 for n in held.host_nodes if not n.comp[part.base + DEV]) if held else 0  # type: ignore[index]

    @staticmethod
    def _states(part: Part, first: int, pages: int) -> int:
        every = part.spec.every
        if every > 0:
            return (first + pages) // every - first // every
        return 1

    def part_slots(self, lease: Lease) -> dict[int, list[tuple[int, int]]]:
        """Per component, (page index, device slot) of what the lease holds on device, in page order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for c, held in lease.parts.items():
            base = self.parts[c].base
            out[c] = sorted((n.depth - 1, n.comp[base + DSLOT]) for n in held.device_nodes)  # type: ignore[index]
        return out
