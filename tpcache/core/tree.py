"""A paged radix tree with one node per page.

Every edge is exactly one page of ``page_size`` token ids, so a divergence always falls on a node
boundary: inserts never split a node and no in-flight copy ever sees its node change shape.
Children are found by the page's exact tokens (a dict keyed by bytes), so a lookup never depends
on a hash being collision-free and a hit costs no hashing; each node also carries its page's
chain hash, the page's identity for digests and storage keys.

Tier data (device page, host slot, storage state, pins) lives on the node; the cache
(``cache.py``) owns every change to it.
"""

from __future__ import annotations

import struct

import xxhash

from tpcache.core.hashing import namespace_seed, root_hash
from tpcache.core.tiers import DeviceState, HostState, StorageState  # noqa: F401

_U64 = struct.Struct("<Q")


class Node:
    __slots__ = (
        "node_id",
        "parent",
        "children",
        "tokens",
        "hash",
        "depth",
        "device_page",
        "device_state",
        "device_pins",
        "host_slot",
        "host_state",
        "host_pins",
        "storage_state",
        "last_access",
        "created_at",
        "hits",
        "record",
    )

    def __init__(self, node_id: int, parent: Node | None, tokens: bytes, hash_: int, clock: int) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # keyed by the child page's tokens
        self.tokens = tokens
        self.hash = hash_
        self.depth = 0 if parent is None else parent.depth + 1
        self.device_page = -1
        self.device_state = DeviceState.NONE
        self.device_pins = 0  # leases and in-flight reads of the device page
        self.host_slot = -1
        self.host_state = HostState.NONE
        self.host_pins = 0  # leases and in-flight reads of the host slot
        self.storage_state = StorageState.NONE
        self.last_access = clock
        self.created_at = clock
        self.hits = 0
        self.record = 0  # this node's current contribution to the state digest

    @property
    def on_device(self) -> bool:
        return self.device_state != DeviceState.NONE

    @property
    def device_valid(self) -> bool:
        return self.device_state == DeviceState.VALID

    @property
    def on_host(self) -> bool:
        return self.host_state != HostState.NONE

    @property
    def resident(self) -> bool:
        """Holds a readable-or-filling copy on device or host. Storage state alone does not keep a
        node: durability is tracked for pages the tree holds, so the tracking is bounded by it."""
        return self.on_device or self.on_host

    def path(self) -> list[Node]:
        """Nodes from the first page down to this one (the root excluded)."""
        out = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return (
            f"Node(id={self.node_id}, depth={self.depth}, dev={self.device_state.name}:{self.device_page}, "
            f"host={self.host_state.name}:{self.host_slot}, storage={self.storage_state.name})"
        )


class Walk:
    """The result of following a token sequence down the tree (pure, nothing is stamped).

    Matched pages are found by their tokens, so a hit costs no hashing; the hash chain of the
    pages past the match is computed only when asked for (``hashes``)."""

    __slots__ = ("nodes", "pages", "_seed", "_root_hash", "_hashes")

    def __init__(self, seed: int, root_hash: int) -> None:
        self.nodes: list[Node] = []  # matched nodes, first page first
        self.pages: list[bytes] = []  # tokens of every full page of the input
        self._seed = seed
        self._root_hash = root_hash
        self._hashes: list[int] | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def hashes(self) -> list[int]:
        """The chain hash of every full page of the input."""
        if self._hashes is None:
            hashes = [n.hash for n in self.nodes]
            h = hashes[-1] if hashes else self._root_hash
            seed, pack, digest = self._seed, _U64.pack, xxhash.xxh3_64_intdigest
            for page in self.pages[len(hashes) :]:
                h = digest(pack(h) + page, seed)  # hashing.page_hash, inlined: the lookup's hot path
                hashes.append(h)
            self._hashes = hashes
        return self._hashes


class RadixTree:
    """Structure only: nodes, lookup, adding and removing leaves."""

    def __init__(self, page_size: int, namespace: str = "") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.namespace = namespace
        self.seed = namespace_seed(namespace)
        self.root = Node(0, None, b"", root_hash(namespace), 0)
        self.nodes: dict[int, Node] = {0: self.root}
        self._next_id = 1

    def walk(self, token_bytes: bytes) -> Walk:
        """Follow the longest existing path of full pages. Pure."""
        walk = Walk(self.seed, self.root.hash)
        pages, nodes = walk.pages, walk.nodes
        step = self.page_size * 4
        node: Node | None = self.root
        for start in range(0, len(token_bytes) - step + 1, step):
            page = token_bytes[start : start + step]
            pages.append(page)
            if node is not None:
                node = node.children.get(page)
                if node is not None:
                    nodes.append(node)
        return walk

    def add_child(self, parent: Node, tokens: bytes, hash_: int, clock: int) -> Node:
        if tokens in parent.children:
            raise ValueError(f"node {parent.node_id} already has a child for this page")
        node = Node(self._next_id, parent, tokens, hash_, clock)
        self._next_id += 1
        parent.children[tokens] = node
        self.nodes[node.node_id] = node
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.parent is None:
            raise ValueError(f"node {node.node_id} is not a removable leaf")
        del node.parent.children[node.tokens]
        del self.nodes[node.node_id]
        node.parent = None

    def __len__(self) -> int:
        return len(self.nodes) - 1
