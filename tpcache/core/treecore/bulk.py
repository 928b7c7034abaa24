"""``TreeCore``'s bulk reads: one call over a path or a list of ids, so that a hot loop pays one
Python call per operation rather than per page. Each returns plain values (ids, states, pages) but
``walk``, a ``Walk`` that orchestration reads by its ``ids`` (and the tree core by its nodes)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore.accounting import unresident
from tpcache.core.treecore.tree import RadixTree, Walk

_VALID = DeviceState.VALID
_HOST_VALID = HostState.VALID


class BulkReads:
    """Reads over many nodes at once (``TreeCore`` inherits them)."""

    tree: RadixTree

    def walk_ids(self, tokens: bytes) -> list[int]:
        """The ids of the longest path of full pages of ``tokens`` (int32 bytes) in the tree, first
        page first. Pure: nothing is stamped."""
        return [n.node_id for n in self.tree.walk(tokens).nodes]

    def device_prefix(self, tokens: bytes, limit: int = -1) -> tuple[int, array]:
        """(count, device pages) of the longest prefix of ``tokens``' path that is device VALID, at
        most ``limit`` pages (-1: no limit): ``count == len(pages)``, the nodes' pages in order. Pure."""
        pages = array("i")
        nodes = self.tree.walk(tokens).nodes
        for n in nodes if limit < 0 else nodes[:limit]:
            if n.device_state != _VALID:
                break
            pages.append(n.device_page)
        return len(pages), pages

    def hit_prefix(self, walk: Walk, host_hits: bool) -> tuple[int, int, array]:
        """(device pages, host pages, the device pages' ids) of the hit along ``walk``: its longest
        device-VALID prefix, then (``host_hits``) the host-VALID pages not on device after it. Pure
        but for the walk's page cache: a whole-path device hit is kept as ``walk.matched_pages``.
        Relies on: a device-VALID page has only device-VALID ancestors (``invariants.check``)."""
        nodes = walk.nodes
        n = len(nodes)
        if nodes and nodes[-1].device_state == _VALID:
            i = n  # the whole path hits
            pages = walk.matched_pages = walk.device_page_ids(i)
        else:
            i = 0
            while i < n and nodes[i].device_state == _VALID:
                i += 1
            pages = walk.device_page_ids(i)
        dev = i
        while host_hits and i < n and nodes[i].host_state == _HOST_VALID and not nodes[i].device_state:
            i += 1
        return dev, i - dev, pages

    def device_sides(self, ids: Iterable[int]) -> list[tuple[int, int]]:
        """(device state, device page) of each node, in order: ``device(i)`` for each id in one pass
        (an insert's plan over its walk)."""
        nodes = self.tree.nodes
        return [(int(n.device_state), n.device_page) for n in (nodes[i] for i in ids)]

    def has_child(self, node_id: int, data: bytes, offset: int) -> bool:
        """The node has a child for the page of ``data`` (int32 bytes) that starts at byte ``offset``;
        a page past the end of ``data`` is no child. Pure."""
        tree = self.tree
        return tree.nodes[node_id].child_at(data, offset, tree.page_size * 4) is not None

    def path_tokens(self, node_id: int) -> bytes:
        """The int32 bytes of the pages from the first page down to this node (the root: empty):
        what ``walk_ids`` walks to reach it. Pure."""
        return b"".join(n.tokens for n in self.tree.nodes[node_id].path())

    def valid_device_pages(self) -> set[int]:
        """Every device page a node holds device-VALID; a new set."""
        return {n.device_page for n in self.tree.nodes.values() if n.device_state == _VALID}

    def walk(self, tokens: bytes, start: int | None = None) -> Walk:
        """The walk of ``tokens`` (int32 bytes) from the root, or from node ``start`` (then the
        tokens are those of the pages below it): ``walk.ids`` are ``walk_ids``'s ids. Pure."""
        return self.tree.walk(tokens, None if start is None else self.tree.nodes[start])

    def load_reach(self, ids: Sequence[int]) -> tuple[int, int, int, int]:
        """A load's rule along a path (``ids``, first page first): (its device-VALID leading pages;
        ``on_device``, its leading pages on device, loading ones included; ``reach``, those plus the
        host-VALID pages not on device right after them, unless a page among the first is LOADING (a
        shared load: nothing under it is loaded); the index of that first LOADING page, or -1).
        ``valid <= on_device <= reach <= len(ids)``. Pure."""
        nodes = self.tree.nodes
        path = [nodes[i] for i in ids]
        valid = 0
        while valid < len(path) and path[valid].device_state == _VALID:
            valid += 1
        on_device, first_loading = valid, -1
        while on_device < len(path) and path[on_device].device_state != DeviceState.NONE:
            if first_loading < 0 and path[on_device].device_state == DeviceState.LOADING:
                first_loading = on_device
            on_device += 1
        reach = on_device
        if first_loading < 0:
            while reach < len(path) and path[reach].host_state == _HOST_VALID and not path[reach].device_state:
                reach += 1
        return valid, on_device, reach, first_loading

    def resident_prefix(self, ids: Sequence[int]) -> int:
        """How many leading nodes of ``ids`` are resident: on device or on host, in any state but NONE."""
        nodes = self.tree.nodes
        k = 0
        while k < len(ids) and nodes[ids[k]].resident:
            k += 1
        return k

    def valid_on_device(self, node_id: int) -> bool:
        """The node's page is device VALID (``device(node_id)[0] == VALID``, without building the pair:
        an insert asks it once per call)."""
        return self.tree.nodes[node_id].device_state == _VALID

    def readable(self, node_id: int) -> bool:
        """New pages may hang from this node: it is the root, or its page is readable (device or
        host VALID)."""
        node = self.tree.nodes[node_id]
        return node.parent is None or node.host_state == _HOST_VALID or node.device_state == _VALID

    def unresident(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` whose node holds a copy on no tier, in order (a long path is filtered in
        one pass, in C where built)."""
        return unresident(self.tree.nodes, ids)

    def tier_states(self, ids: Iterable[int]) -> list[tuple[int, int, int]]:
        """(device state, host state, storage state) of each node, in order."""
        nodes = self.tree.nodes
        return [(n.device_state, n.host_state, n.storage_state) for n in (nodes[i] for i in ids)]

    def device_pages(self, ids: Iterable[int]) -> list[int]:
        """The device page of each node, in order (-1 where it has none)."""
        nodes = self.tree.nodes
        return [nodes[i].device_page for i in ids]

    def host_slots(self, ids: Iterable[int]) -> list[int]:
        """The host slot of each node, in order (-1 where it has none)."""
        nodes = self.tree.nodes
        return [nodes[i].host_slot for i in ids]

    def copy_sides(self, ids: Sequence[int], full_index: Sequence[int] | None) -> tuple[list[int], list[int], list]:
        """(device pages, host slots, page hashes) for a copy over ``ids``: the pages and slots of the
        nodes at ``full_index`` (None: all), whose full page the copy moves, and every node's hash."""
        nodes = [self.tree.nodes[i] for i in ids]
        movers = nodes if full_index is None else [nodes[i] for i in full_index]
        return [n.device_page for n in movers], [n.host_slot for n in movers], [n.hash for n in nodes]

    def depths(self, ids: Iterable[int]) -> list[int]:
        """Each node's depth, in order: its page count from the root (a first page: 1; the root: 0).
        A node's depth never changes while it lives; along a path it grows by one a page."""
        nodes = self.tree.nodes
        return [nodes[i].depth for i in ids]

    def hit_counts(self, ids: Iterable[int]) -> list[int]:
        """Each node's hit count, in order (the hits stamped on it; it never decreases while the node lives)."""
        nodes = self.tree.nodes
        return [nodes[i].hits for i in ids]

    def page_hashes(self, ids: Iterable[int]) -> list[int]:
        """The chain hash of each node's page, in order (its identity in digests and storage keys)."""
        nodes = self.tree.nodes
        return [nodes[i].hash for i in ids]

    def path_union(self, ids: Iterable[int]) -> list[int]:
        """Every id on the paths from the root to these nodes, each once, the root excluded, in a fixed
        order: each node's path upwards, stopping at a node already listed."""
        nodes = self.tree.nodes
        seen: set[int] = set()
        out: list[int] = []
        for node_id in ids:
            cur = nodes[node_id]
            while cur.parent is not None and cur.node_id not in seen:
                seen.add(cur.node_id)
                out.append(cur.node_id)
                cur = cur.parent
        return out

    def path_on_device(self, ids: Iterable[int]) -> list[int]:
        """``ids_on_device(path_union(ids))`` in one pass."""
        nodes = self.tree.nodes
        seen: set[int] = set()
        out: list[int] = []
        for node_id in ids:
            cur = nodes[node_id]
            while cur.parent is not None and cur.node_id not in seen:
                seen.add(cur.node_id)
                if cur.device_state:
                    out.append(cur.node_id)
                cur = cur.parent
        return out

    def ids_on_device(self, ids: Iterable[int]) -> list[int]:
        """Those of ``ids`` whose device state is not NONE (valid or filling), in order."""
        nodes = self.tree.nodes
        return [i for i in ids if nodes[i].device_state != DeviceState.NONE]
