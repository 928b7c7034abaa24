"""Tree nodes in C (``tpcache/core/treecore/_node.c``): untracked by the garbage collector, freed when their
tree goes, and held equal to the pure-Python reference node (``tree.PyNode``) by running the same
schedules with each and comparing everything that decides what a rank does."""

from __future__ import annotations

import copy
import gc
import json
import os
import random
import subprocess
import sys
import textwrap
from array import array
from pathlib import Path

import pytest

from tpcache.core import CacheConfig, CacheCore
from tpcache.core.tiers import DeviceState
from tpcache.core.treecore.tree import NATIVE_NODES, Node, PyNode, RadixTree, Run
from tpcache.replay import drain

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")

REPO = Path(__file__).resolve().parents[2]

# The same schedules, printed as (digest, snapshot) per seed: with and without the extension.
SCHEDULES = textwrap.dedent(
    """
    import json, sys
    SEEDS = [(3, None), (11, None), (27, None), (5, "both"), (8, "swa")]
    from tpcache.core.treecore.tree import NATIVE_NODES
    from tpcache.testing import sim
    out = {"native": NATIVE_NODES, "runs": []}
    for seed, hybrid in SEEDS:
        cluster = sim.run_schedule(seed, 2, hybrid=hybrid)
        core = cluster.ranks[0].core
        out["runs"].append([core.digest.value, json.dumps(sim.snapshot(core), default=str), cluster.log])
    print(json.dumps(out))
    """
)


def _schedules(mode: str) -> dict:
    env = {**os.environ, "TPCACHE_TREE_CORE": mode}
    done = subprocess.run(
        [sys.executable, "-c", SCHEDULES], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_native_and_reference_nodes_reach_the_same_states():
    native, pure = _schedules("native"), _schedules("reference")
    assert (native["native"], pure["native"]) == (True, False)
    assert len(native["runs"]) == 5
    for i, (a, b) in enumerate(zip(native["runs"], pure["runs"], strict=True)):
        assert a == b, f"schedule {i}: native and reference nodes diverge"


def test_nodes_and_their_children_dicts_are_not_tracked():
    core = CacheCore(CacheConfig(page_size=4, device_pages=8))
    for first in (0, 100):  # two branches below the root: its children are a dict
        tokens = [first + t for t in range(12)]
        lease, m = core.lock(tokens)
        core.insert(lease, tokens, core.alloc(lease, 3))
    assert core.tree.root.num_children == 2
    for node in core.tree.nodes.values():
        assert not gc.is_tracked(node)
    holding_nodes = [o for o in gc.get_objects() if type(o) is dict and any(type(v) is Node for v in o.values())]
    assert holding_nodes == []  # the tree's nodes dict and the root's children dict stay untracked too
    assert gc.is_tracked(PyNode(1, None, b"", 0, 0))  # what the extension spares the collector


def test_nothing_the_collector_walks_grows_with_a_native_cache() -> None:
    """Short sequences cached and hit again and again (a run cache for each, stale eviction heap
    entries piling up to a rebuild) leave the collector as many objects to walk as a nearly empty
    cache does: the heaps hold ints, the runs and their page arrays refer to native nodes only, and
    none of them is tracked. (Tracked, 300k pages in 150k such sequences made each full collection
    take over 100 ms.)"""
    if not NATIVE_NODES:
        pytest.skip("the native extension is not built")

    def tracked_after(sequences: int) -> tuple[int, int]:
        core = CacheCore(CacheConfig(page_size=4, device_pages=4 * sequences + 8))
        seqs = [array("i", [i, 1, 2, 3, i, 5, 6, 7]).tobytes() for i in range(sequences)]
        for s in seqs:
            lease, _ = core.lock(s)
            core.insert(lease, s, core.alloc(lease, 2))
            core.release(lease)
            drain(core)
        for _ in range(3):
            for s in reversed(seqs):
                lease, _ = core.lock(s)
                core.release(lease)
                drain(core)
        del seqs
        gc.collect()
        count = len(gc.get_objects())
        heap = len(core.evictor.candidates.device_heap)
        core.close("done")
        return count, heap

    few, _ = tracked_after(20)
    many, heap = tracked_after(3000)
    assert heap > 3000  # stale entries did pile up
    assert many - few < 100, f"{many - few} more objects tracked with 3000 sequences cached than with 20"


def test_children_keep_their_shape_and_stay_read_only():
    """A node holds no dict for no child or one child, a dict for two or more, back to one when a
    child goes; the reference node gives the same answers, and neither lets ``children`` change."""
    tree = RadixTree(1)
    ref = PyNode(0, None, b"", 0, 0)
    a, b, c = b"aaaa", b"bbbb", b"cccc"
    kids = {k: tree.add_child(tree.root, k, i, 0) for i, k in enumerate((a, b, c))}
    refs = {k: PyNode(i + 1, ref, k, i, 0) for i, k in enumerate((a, b, c))}
    for k in (a, b, c):
        ref.link(refs[k])
    for gone in (b, a, c):
        assert tree.root.num_children == ref.num_children
        assert sorted(tree.root.children) == sorted(ref.children)
        for k in (a, b, c):
            assert (tree.root.child(k) is kids[k]) == (ref.child(k) is refs[k]) == (k in ref.children)
        assert (tree.root.only_child is None) == (ref.only_child is None)
        tree.remove_leaf(kids[gone])
        ref.unlink(refs[gone])
    assert tree.root.num_children == 0 and dict(tree.root.children) == {} and tree.root.only_child is None
    with pytest.raises(TypeError):
        tree.root.children[a] = kids[a]  # type: ignore[index]
    with pytest.raises(KeyError):
        tree.root.unlink(kids[a])
    node = tree.add_child(tree.root, a, 1, 0)
    with pytest.raises(ValueError, match="already has a child"):
        tree.add_child(tree.root, a, 2, 0)
    ref.link(refs[a])
    with pytest.raises(ValueError, match="already has a child"):
        ref.link(PyNode(9, ref, a, 0, 0))
    assert tree.root.only_child is node


@pytest.mark.parametrize("page_tokens", [4, 512])
def test_many_children_are_found_by_their_tokens_as_the_reference_finds_them(page_tokens: int) -> None:
    """Past a few children a node keeps them in a dict keyed by their tokens (hashed with XXH3, compared
    in full): every lookup, link and unlink, through a branch point's growth to 40 children and back,
    answers as the reference node does, keeps the order children were added, and never confuses two
    pages that share all but their last token."""
    tree = RadixTree(page_tokens)
    ref = PyNode(0, None, b"", 0, 0)
    step = page_tokens * 4
    pages = [bytes(step - 1) + bytes([i]) for i in range(40)]  # alike but for the last byte
    kids, refs = {}, {}
    for i, k in enumerate(pages):
        kids[k] = tree.add_child(tree.root, k, i, 0)
        refs[k] = PyNode(i + 1, ref, k, i, 0)
        ref.link(refs[k])
    strangers = [bytes(step - 1) + bytes([200]), b"x" * step, b"", pages[0][:-1]]
    rng = random.Random(7)
    order = pages[:]
    rng.shuffle(order)
    for gone in order:
        assert tree.root.num_children == ref.num_children
        assert [c.tokens for c in tree.root.child_nodes()] == [c.tokens for c in ref.child_nodes()]
        assert dict(tree.root.children).keys() == ref.children.keys()
        for k in pages + strangers:
            mine, theirs = tree.root.child(k), ref.child(k)
            assert (mine is kids.get(k)) and (theirs is refs.get(k))
            assert tree.root.child_at(b"?" + k, 1, len(k)) is mine
        node = kids.pop(gone)
        tree.remove_leaf(node)
        ref.unlink(refs.pop(gone))
        with pytest.raises(KeyError):
            tree.root.unlink(node)
    assert tree.root.num_children == 0 and tree.root.child_nodes() == []


def test_a_dropped_tree_frees_its_nodes():
    """The collector cannot see the child-to-parent cycles of native nodes: the tree breaks them
    itself, so dropping a core (or an agreed flush's reset) frees every node."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=8))
    lease, _ = core.lock(list(range(12)))
    core.insert(lease, list(range(12)), core.alloc(lease, 3))
    core.match(list(range(12)))  # cached runs: node -> run -> node cycles too
    leaf = max(core.tree.nodes.values(), key=lambda n: n.depth)
    assert leaf.depth == 3 and sys.getrefcount(leaf) > 2
    del core, lease
    gc.collect()
    assert leaf.parent is None and sys.getrefcount(leaf) == 2  # this test's name and the call's argument

    tree = RadixTree(4)
    a = tree.add_child(tree.root, b"x" * 16, 1, 0)
    tree.add_child(a, b"y" * 16, 2, 0)
    del tree
    assert a.parent is None and sys.getrefcount(a) == 2


def test_pages_leaving_the_tree_leave_no_cycle_behind():
    """A node leaves the tree without a reference to a cached run (a run's page cache covers the
    host-only pages of its chain too): nothing the collector cannot see outlives the tree's pages."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=64, host_pages=64, write_policy="write_through"))
    for i in range(60):
        tokens = [i * 1000 + t for t in range(16)]
        lease, _ = core.lock(tokens)
        core.insert(lease, tokens, core.alloc(lease, 4))
        drain(core)
        core.release(lease)
        drain(core)
        core.evict_device(1)
        core.match(tokens)  # caches the run's pages, the host-only last page included
        core.evict_host(1)
        core.evict_device(64), core.evict_host(64)
    assert len(core.tree) == 0
    gc.collect()
    assert sum(1 for o in gc.get_objects() if type(o) is Run) == 0


def test_a_native_node_has_the_reference_nodes_fields_and_behaviour():
    tree = RadixTree(4)
    parent = tree.add_child(tree.root, b"p" * 16, 2**64 - 1, 5)
    node = tree.add_child(parent, b"c" * 16, 7, 6)
    ref_parent = PyNode(1, None, b"p" * 16, 2**64 - 1, 5)
    ref = PyNode(2, ref_parent, b"c" * 16, 7, 6)
    ref_parent.depth = parent.depth
    ref.depth = node.depth
    for name in PyNode.__slots__:
        if name not in ("parent", "children"):
            assert getattr(node, name) == getattr(ref, name), name
    assert node.depth == 2 and node.hash == 7 and parent.hash == 2**64 - 1
    for state, expect in ((0, (False, False)), (1, (True, False)), (2, (True, True))):
        node.device_state = ref.device_state = state
        assert (node.on_device, node.device_valid) == (ref.on_device, ref.device_valid) == expect
        assert node.resident == ref.resident
    node.host_state = ref.host_state = 1
    assert node.on_host and node.resident and ref.on_host
    assert [n.node_id for n in node.path()] == [parent.node_id, node.node_id]
    assert repr(node) == repr(ref).replace("id=2", f"id={node.node_id}")
    other = copy.copy(node)
    assert type(other) is Node and other is not node and other.parent is parent and other.record == node.record
    with pytest.raises(TypeError, match="parent"):
        Node(9, "not a node", b"", 0, 0)


def test_a_native_node_of_a_16_token_page_is_one_208_byte_block_of_c_integers():
    # Every number a node holds is a C integer as wide as its values need, not an int object of its
    # own: a node of 16-token pages takes one of pymalloc's 208-byte blocks and no more.
    node = Node(2**63 - 1, None, bytes(64), 2**64 - 1, 2**63 - 1)
    assert sys.getsizeof(node) <= 208
    assert (node.node_id, node.hash, node.depth, node.run_at) == (2**63 - 1, 2**64 - 1, 0, 0)
    assert (node.last_access, node.created_at, node.hits) == (2**63 - 1, 2**63 - 1, 0)
    widths = {"device_state": 8, "host_state": 8, "storage_state": 8, "device_pins": 32, "host_pins": 32}
    widths |= {"device_page": 32, "host_slot": 32, "run_at": 32, "last_access": 64, "created_at": 64, "hits": 64}
    for name, bits in widths.items():
        for value in (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1):  # the field's whole range, read back as ints
            setattr(node, name, value)
            assert getattr(node, name) == value and type(getattr(node, name)) is int, name
        for value in (-(2 ** (bits - 1)) - 1, 2 ** (bits - 1)):  # never a value cut short
            with pytest.raises(OverflowError, match=name):
                setattr(node, name, value)
        with pytest.raises(TypeError, match=name):
            setattr(node, name, 1.5)
        setattr(node, name, 1)
    node.device_state = DeviceState.VALID  # a tier state is an IntEnum member, read back as its int
    assert node.device_state == DeviceState.VALID and node.device_valid
    for i, name in enumerate(widths):  # a copy has every number (a reused node's memory holds old ones)
        setattr(node, name, i + 2)
    other = copy.copy(node)
    assert [getattr(other, name) for name in (*widths, "node_id", "hash", "record", "depth")] == [
        getattr(node, name) for name in (*widths, "node_id", "hash", "record", "depth")
    ]
    for name in ("node_id", "depth"):  # fixed when the node is made
        with pytest.raises(AttributeError):
            setattr(node, name, 1)
    with pytest.raises(AttributeError, match="device_pins"):
        del node.device_pins
    with pytest.raises(OverflowError):
        Node(2**63, None, b"", 0, 0)
    child = Node(7, node, bytes(64), 1, 5)
    assert child.depth == 1 and repr(child).startswith("Node(id=7, depth=1, dev=NONE:-1,")


def _pair(count: int, size: int = 8) -> tuple[Node, PyNode, list[bytes]]:
    """A native node and a reference node, each with ``count`` children of ``size``-byte pages."""
    tree = RadixTree(size // 4)
    ref = PyNode(0, None, b"", 0, 0)
    pages = [i.to_bytes(4, "little") * (size // 4) for i in range(count)]
    for i, page in enumerate(pages):
        tree.add_child(tree.root, page, i, 0)
        ref.link(PyNode(i + 1, ref, page, i, 0))
    return tree.root, ref, pages


@pytest.mark.parametrize("count", [0, 1, 2, 16, 17, 40])
def test_a_child_at_a_position_is_the_child_of_that_slice(count):
    """``child_at(data, pos, step)`` is ``child(data[pos:pos + step])`` on both node types, whether the
    node scans its few children or looks many up by their tokens, a slice clipped at the end included."""
    node, ref, pages = _pair(count)
    data = b"".join(pages) + b"\x07" * 8 + (pages[0][:4] if pages else b"")
    for step in (8, 4):
        for pos in range(0, len(data) + 9, 4):
            want = node.child(data[pos : pos + step])
            assert node.child_at(data, pos, step) is want
            got, expect = ref.child_at(data, pos, step), ref.child(data[pos : pos + step])
            assert got is expect and (got is None) == (want is None)
    for bad in (node, ref):
        with pytest.raises(ValueError):
            bad.child_at(data, -1, 8)


@pytest.mark.parametrize("count", [2, 16, 17, 40])
def test_children_go_one_by_one_whether_scanned_or_looked_up(count):
    node, ref, pages = _pair(count)
    kids = {page: node.child(page) for page in pages}
    for i, page in enumerate(pages[::-1]):
        node.unlink(kids[page])
        ref.unlink(ref.child(page))
        assert node.num_children == ref.num_children == count - i - 1
        assert sorted(node.children) == sorted(ref.children)
        with pytest.raises(KeyError):
            node.unlink(kids[page])


def test_a_chain_below_a_node_is_gathered_as_the_reference_does():
    from tpcache.core.treecore._node import chain_below

    tree = RadixTree(2)
    pages = [bytes([i]) * 8 for i in range(1, 6)]
    top = tree.add_chain(tree.root, pages, list(range(5)), 0)
    nodes, data, ids = chain_below(tree.root)
    assert nodes == tuple(top) and data == b"".join(pages) and ids == tuple(n.node_id for n in top)
    assert all(a is n.node_id for a, n in zip(ids, top, strict=True))  # the nodes' own id objects
    assert not gc.is_tracked(nodes) and not gc.is_tracked(ids)  # nothing in them a collection could free
    tree.add_child(top[2], b"z" * 8, 9, 0)  # a second child ends the chain at top[2]
    nodes, data, ids = chain_below(tree.root)
    assert nodes == tuple(top[:3]) and data == b"".join(pages[:3]) and ids == tuple(n.node_id for n in top[:3])
    assert chain_below(top[-1]) == ((), b"", ()) and chain_below(PyNode(0, None, b"", 0, 0)) is None


def test_nodes_made_after_others_went_are_fresh():
    """Nodes freed by eviction are reused for the next ones of the same size: each comes with the
    fields a new node has, and its own tokens."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=8))
    for round_ in range(6):
        tokens = [round_ * 100 + t for t in range(32)]
        lease, _ = core.lock(tokens)
        core.insert(lease, tokens, core.alloc(lease, 8))  # evicts the previous round's 8 pages
        core.release(lease)
        drain(core)
        nodes = sorted(core.tree.nodes.values(), key=lambda n: n.depth)[1:]
        assert [n.tokens for n in nodes] == [core_bytes(tokens[i * 4 : i * 4 + 4]) for i in range(8)]
        for n in nodes:
            assert (n.host_slot, n.host_state, n.host_pins, n.storage_state, n.hits, n.comp) == (-1, 0, 0, 0, 0, None)
            assert n.device_pins == 0 and n.run_at == 0 and n.pages_run is None
    fresh = Node(99, None, b"q" * 16, 3, 4)
    assert (fresh.tokens, fresh.hash, fresh.device_page, fresh.num_children, fresh.record) == (b"q" * 16, 3, -1, 0, 0)


def core_bytes(tokens: list[int]) -> bytes:
    from tpcache.core.hashing import as_token_bytes

    return as_token_bytes(tokens)


def test_the_nodes_a_release_may_drop_are_found_as_the_reference_finds_them():
    from tpcache.core.treecore._node import unresident

    from tpcache.core.treecore.accounting import _py_unresident

    tree = RadixTree(1)
    ids = []
    for i, (dev, host) in enumerate([(0, 0), (2, 0), (0, 1), (1, 2), (0, 0)]):
        node = tree.add_child(tree.root, bytes([i]) * 4, i, 0)
        node.device_state, node.host_state = dev, host
        ids.append(node.node_id)
    gone = max(ids) + 1  # an id not in the tree holds nothing: left out
    assert unresident(tree.nodes, ids + [gone]) == _py_unresident(tree.nodes, ids + [gone]) == [ids[0], ids[4]]
    assert unresident(tree.nodes, []) == [] and unresident(tree.nodes, tuple(ids[:1])) == ids[:1]
    with pytest.raises(TypeError):
        unresident(tree.nodes, [tree.nodes[ids[0]]])  # a handle, not an id
