"""A paged radix tree with one node per page.

Every edge is exactly one page of ``page_size`` token ids, so a divergence always falls on a node
boundary: inserts never split a node and no in-flight copy ever sees its node change shape.
Children are found by the page's exact tokens (compared in full: a dict keyed by bytes here, by
the tokens in place in the native node), so a lookup never depends on a hash being collision-free;
each node also carries its page's chain hash, the page's identity for digests and storage keys.

Tier data (device page, host slot, storage state, pins, and a hybrid model's per-component record)
lives on the node; the ledger (``ledger.py``) makes every change to it.
"""

from __future__ import annotations

import struct
from array import array

import xxhash

from tpcache.core.backend import NATIVE
from tpcache.core.hashing import namespace_seed, root_hash
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.runs import Run, agreeing, drop_pages, mark

_U64 = struct.Struct("<Q")

# A walk caches chains as runs (``_run``) only for pages of fewer than this many bytes of tokens.
# A run saves the walk one Python step per page, which is most of a small page's cost; building
# one copies the chain's tokens once more, which is most of a large page's. The two cost the same
# near 48-token pages (docs/benchmarks.md has the measurement).
RUN_PAGE_BYTES = 4 * 48


class PyNode:
    """One page of the tree: the reference implementation of ``_node.Node`` (the same fields,
    methods and behaviour in C), used where the extension is not built. A node of the C type is
    never tracked by the garbage collector (nor is a children dict holding only such nodes), so a full
    collection costs what the rest of the process holds, not the cache's size; and it is compact:
    its tokens inline, a single child without a dict, its hash, record, device page and host slot
    as C integers. On both types children change only through ``link`` and ``unlink`` (the C
    type's ``children`` is a read-only view)."""

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
        "comp",
        "record",
        "run",
        "run_at",
        "pages_run",
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
        self.comp: list[int] | None = None  # per-component data of a hybrid model (components.py)
        self.record = 0  # this node's current contribution to the state digest
        self.run: Run | None = None  # the chain below, cached (tree._run), and where my child is in it:
        self.run_at = 0  # (an index, not a tuple with the run: a tuple would be tracked by the collector)
        self.pages_run: Run | None = None  # the run whose cached device pages include this node

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
    def num_children(self) -> int:
        return len(self.children)

    @property
    def only_child(self) -> Node | None:
        """The child when there is exactly one, else None."""
        if len(self.children) != 1:
            return None
        (child,) = self.children.values()
        return child

    def child(self, tokens: bytes) -> Node | None:
        """The child for these page tokens, or None."""
        return self.children.get(tokens)

    def child_nodes(self) -> list[Node]:
        """The children, in the order they were added (a new list)."""
        return list(self.children.values())

    def child_at(self, data: bytes, pos: int, step: int) -> Node | None:
        """``child(data[pos : pos + step])`` for ``pos`` >= 0 (the C type needs no slice)."""
        if pos < 0 or step < 0:
            raise ValueError("child_at takes bytes and a position and a length of at least 0")
        return self.children.get(data[pos : pos + step])

    def link(self, child: Node) -> None:
        """Add a child under its tokens (``children`` changes only here and in ``unlink``)."""
        if child.tokens in self.children:
            raise ValueError(f"node {self.node_id} already has a child for this page")
        self.children[child.tokens] = child

    def unlink(self, child: Node) -> None:
        if self.children.get(child.tokens) is not child:
            raise KeyError(f"node {child.node_id} is not a child of node {self.node_id}")
        del self.children[child.tokens]

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
            f"Node(id={self.node_id}, depth={self.depth}, dev={DeviceState(self.device_state).name}:"
            f"{self.device_page}, host={HostState(self.host_state).name}:{self.host_slot}, "
            f"storage={StorageState(self.storage_state).name})"
        )

    def __copy__(self) -> PyNode:
        other = PyNode.__new__(PyNode)
        for name in PyNode.__slots__:
            setattr(other, name, getattr(self, name))
        return other


Node, _chain_below = (NATIVE.Node, NATIVE.chain_below) if NATIVE is not None else (PyNode, None)
# The tree's nodes by id: under the native core a NodeTable (_table.c: a hash table on int64 ids, no int
# key or dict entry per node; the kernels find, add and drop nodes there by their int64 ids), under the
# reference a dict. Both list ids in ascending order: the dict's insertion order, since a node goes in
# when it is made, with the next id, and no id is ever made again (the table sorts its ids to list them).
NodeTable = NATIVE.NodeTable if NATIVE is not None else dict

NATIVE_NODES = Node is not PyNode


if NATIVE is not None:  # what the C kernels clear and copy, bound once (_bind.c)
    NATIVE.bind(Run.__dict__["pages"], array("i", [0]), array("q", [0]))


class Walk:
    """The result of following a token sequence down the tree (pure, nothing is stamped).

    Matched pages are found by their tokens, so a hit costs no hashing; page slices and the hash
    chain of the pages past the match are computed only when asked for."""

    __slots__ = ("nodes", "num_pages", "segments", "matched_pages", "_tokens", "_step", "_seed", "_root_hash")
    __slots__ += ("_pages", "_hashes", "ids")  # (the caches; ``ids``: the nodes' ids, made with them)

    def __init__(self, token_bytes: bytes, step: int, seed: int, root_hash: int) -> None:
        self.nodes: list[Node] = []  # matched nodes, first page first
        # how ``nodes`` was found, in order: (run, first, count) for a run slice, a Node for one step
        self.segments: list[tuple[Run, int, int] | Node] = []
        self.num_pages = len(token_bytes) // step  # full pages of the input
        # device_page_ids(len(nodes)) as CacheCore.match read it, all VALID (or None): true while pinned
        self.matched_pages: array | None = None
        self._tokens = token_bytes
        self._step = step
        self._seed = seed
        self._root_hash = root_hash
        self._pages: list[bytes] | None = None
        self._hashes: list[int] | None = None
        self.ids: list[int] = []  # the matched nodes' ids, first page first (slices of the runs' ids)

    def device_page_ids(self, count: int) -> array:
        """The device pages of the first ``count`` matched nodes (copied from run caches)."""
        out = array("i")
        for seg in self.segments:
            if len(out) >= count:
                break
            if type(seg) is tuple:
                run, first, n = seg
                n = min(n, count - len(out))
                if run.pages is None and 2 * n < len(run.nodes):
                    # a short slice of a long run: read its nodes rather than cache the whole run
                    out.extend([node.device_page for node in run.nodes[first : first + n]])
                else:
                    out += run.device_pages()[first : first + n]
            else:
                out.append(seg.device_page)
        return out

    @property
    def token_bytes(self) -> bytes:
        """The input, as int32 bytes."""
        return self._tokens

    @property
    def step(self) -> int:
        """Bytes per page."""
        return self._step

    @property
    def pages(self) -> list[bytes]:
        """The tokens of every full page of the input."""
        if self._pages is None:
            t, step = self._tokens, self._step
            self._pages = [t[i : i + step] for i in range(0, self.num_pages * step, step)]
        return self._pages

    @property
    def hashes(self) -> list[int]:
        """The chain hash of every full page of the input."""
        if self._hashes is None:
            hashes = [n.hash for n in self.nodes]
            h = hashes[-1] if hashes else self._root_hash
            seed, pack, digest = self._seed, _U64.pack, xxhash.xxh3_64_intdigest
            t, step = self._tokens, self._step
            for start in range(len(hashes) * step, self.num_pages * step, step):
                h = digest(pack(h) + t[start : start + step], seed)  # hashing.page_hash, inlined
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
        self.nodes: dict[int, Node] = NodeTable()  # (a NodeTable reads as this dict)
        self.nodes[0] = self.root
        self._next_id = 1

    def walk(self, token_bytes: bytes, start: Node | None = None) -> Walk:
        """Follow the longest existing path of full pages, from the root or from ``start`` (then the
        tokens are those of the pages below it, and the walk's nodes and hashes continue its path).
        Pure (it may fill the run caches).

        With pages of fewer than 48 tokens (``RUN_PAGE_BYTES``), along a chain of single-child nodes
        the walk compares the whole chain's tokens at once (one memcmp) instead of looking pages up one
        by one; see ``_run``. With larger pages it looks each page up in its parent (one compare of
        the page's tokens where they lie, in C for native nodes): the same nodes, found without
        copying the chain's tokens into a run first."""
        step = self.page_size * 4
        runs = step < RUN_PAGE_BYTES
        node = self.root if start is None else start
        walk = Walk(token_bytes, step, self.seed, node.hash)
        nodes, ids = walk.nodes, walk.ids
        segments = walk.segments
        end = walk.num_pages * step
        pos = 0
        while pos < end:
            if runs and node.num_children == 1:
                run, first = (node.run, node.run_at) if node.run is not None else self._run(node)
                chain = run.nodes
                offset = first * step
                count = min(len(chain) - first, (end - pos) // step)
                size = count * step
                # (a long stretch is compared through a view: a slice would copy it first)
                part = run.data[offset : offset + size] if size < 4096 else memoryview(run.data)[offset : offset + size]
                if token_bytes.startswith(part, pos):
                    nodes.extend(chain[first : first + count])
                    ids.extend(run.ids[first : first + count])
                    segments.append((run, first, count))
                    pos += count * step
                    node = chain[first + count - 1]
                    continue
                # The pages diverge inside the chain: every node on it has one child, so the
                # match ends at the last page that agrees.
                lo = agreeing(token_bytes, pos, run, first, count, step)
                if lo:
                    nodes.extend(chain[first : first + lo])
                    ids.extend(run.ids[first : first + lo])
                    segments.append((run, first, lo))
                return walk
            child = node.child_at(token_bytes, pos, step)
            if child is None:
                break
            nodes.append(child)
            ids.append(child.node_id)
            segments.append(child)
            pos += step
            node = child
        return walk

    def _run(self, node: Node) -> tuple[Run, int]:
        """Build the run cache of the single-child chain below ``node``.

        ``node.run = Run((c1..ck), tokens of c1..ck, their ids)``, ``node.run_at = 0``, where c1 is node's only
        child and each next node is its predecessor's only child; every chain node ci except the last
        gets the same run with its own start (``run_at = i``). Invariant: a run never spans a node
        with two or more children; ``_invalidate`` keeps it so when a child is added or removed. A run
        shorter than the chain (the chain grew at its end) is still correct: the walk goes on from its
        last node.
        """
        found = None if _chain_below is None else _chain_below(node)  # the same, from the nodes' inline tokens
        if found is None:
            chain: list[Node] = []
            cur = node.only_child
            while cur is not None:
                chain.append(cur)
                cur = cur.only_child
            found = tuple(chain), b"".join(c.tokens for c in chain), tuple([c.node_id for c in chain])
        run = Run(*found)
        mark(run, node)
        return run, 0

    @staticmethod
    def _invalidate(node: Node) -> None:
        """Drop the runs through ``node`` (it gained a second child or lost its only one): its own
        and those of the single-child ancestors above it (all or none of them have one)."""
        cur: Node | None = node
        while cur is not None and cur.run is not None:
            cur.run = None
            cur = cur.parent

    def add_child(self, parent: Node, tokens: bytes, hash_: int, clock: int) -> Node:
        if parent.child(tokens) is not None:
            raise ValueError(f"node {parent.node_id} already has a child for this page")
        node = Node(self._next_id, parent, tokens, hash_, clock)
        self._next_id += 1
        parent.link(node)
        self.nodes[node.node_id] = node
        if parent.num_children == 2:
            self._invalidate(parent)
        return node

    def add_chain(self, parent: Node, tokens: list[bytes], hashes: list[int], clock: int) -> list[Node]:
        """``add_child`` for each page in turn, each below the one before: the same nodes and ids."""
        if tokens and parent.child(tokens[0]) is not None:
            raise ValueError(f"node {parent.node_id} already has a child for this page")
        out: list[Node] = []
        nodes, next_id, first = self.nodes, self._next_id, parent
        for page, hash_ in zip(tokens, hashes, strict=True):
            node = Node(next_id, parent, page, hash_, clock)
            parent.link(node)
            nodes[next_id] = node
            next_id += 1
            out.append(node)
            parent = node
        self._next_id = next_id
        if first.num_children == 2:
            self._invalidate(first)
        return out

    def remove_leaf(self, node: Node) -> None:
        if node.num_children or node.parent is None:
            raise ValueError(f"node {node.node_id} is not a removable leaf")
        parent = node.parent
        parent.unlink(node)
        del self.nodes[node.node_id]
        drop_pages(node)  # a host-only node may still be in a run's page cache
        node.parent = node.run = None  # no cycle outlives it (the collector cannot see native nodes)
        if not parent.num_children:
            self._invalidate(parent)

    def __len__(self) -> int:
        return len(self.nodes) - 1

    def dispose(self) -> None:
        """Break the tree's reference cycles (child to parent, node to its cached run) so that
        reference counting frees it: with native nodes the collector cannot see these cycles.
        Called when the tree is dropped; the tree is empty afterwards."""
        for node in getattr(self, "nodes", {}).values():  # (a tree whose __init__ raised has none)
            node.parent = node.run = node.pages_run = None
        self.nodes = NodeTable()

    def __del__(self) -> None:
        self.dispose()
