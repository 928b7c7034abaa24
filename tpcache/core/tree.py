"""A paged radix tree with one node per page.

Every edge is exactly one page of ``page_size`` token ids, so a divergence always falls on a node
boundary: inserts never split a node and no in-flight copy ever sees its node change shape.
Children are found by the page's chain hash and confirmed by comparing the page's tokens, so a
64-bit hash collision is a miss, never a wrong hit.

Tier data (device page, host slot, storage state, pins) lives on the node; the cache
(``cache.py``) owns every change to it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

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
        self.children: dict[int, Node] = {}
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


@dataclass
class Walk:
    """The result of following a token sequence down the tree (pure, nothing is stamped)."""

    nodes: list[Node] = field(default_factory=list)  # matched nodes, first page first
    hashes: list[int] = field(default_factory=list)  # chain hash of every full page of the input
    pages: list[bytes] = field(default_factory=list)  # tokens of every full page of the input


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
        """Hash every full page and follow the longest existing path. Pure.

        The hot path of every lookup: the hash chain is inlined (``hashing.page_hash``)."""
        walk = Walk()
        hashes, pages, nodes = walk.hashes, walk.pages, walk.nodes
        step = self.page_size * 4
        seed, pack, digest = self.seed, _U64.pack, xxhash.xxh3_64_intdigest
        node: Node | None = self.root
        h = self.root.hash
        for start in range(0, len(token_bytes) - step + 1, step):
            page = token_bytes[start : start + step]
            h = digest(pack(h) + page, seed)
            hashes.append(h)
            pages.append(page)
            if node is not None:
                child = node.children.get(h)
                if child is not None and child.tokens == page:
                    nodes.append(child)
                    node = child
                else:
                    node = None  # keep hashing the rest: callers need every page's hash
        return walk

    def add_child(self, parent: Node, tokens: bytes, hash_: int, clock: int) -> Node:
        existing = parent.children.get(hash_)
        if existing is not None:
            # Same chain hash, different tokens: a 64-bit collision. Refuse rather than alias.
            raise HashCollision(f"page hash {hash_:016x} collides under node {parent.node_id}")
        node = Node(self._next_id, parent, tokens, hash_, clock)
        self._next_id += 1
        parent.children[hash_] = node
        self.nodes[node.node_id] = node
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.parent is None:
            raise ValueError(f"node {node.node_id} is not a removable leaf")
        del node.parent.children[node.hash]
        del self.nodes[node.node_id]
        node.parent = None

    def __len__(self) -> int:
        return len(self.nodes) - 1


class HashCollision(RuntimeError):
    """Two different pages hashed to the same chain hash under one parent."""
