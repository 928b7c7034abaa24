"""The native core's nodes by id (``_node.NodeTable``, ``tpcache/core/treecore/_table.c``) held to the reference
core's ``dict[int, Node]``: the same answers to every read the code makes, ids listed in ascending order (the
dict's insertion order in a tree), KeyError for an id it does not hold, and memory that follows the live
nodes, however their ids are spread over the ids ever made."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from tpcache.core.backend import NATIVE
from tpcache.core.treecore.tree import NATIVE_NODES, Node, RadixTree

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")

STRETCH = 128  # a stretch of ids the schedules below use (the table has no unit of ids: it hashes them)
SLOT = 16  # bytes a slot of the table takes: an int64 id and a node pointer (TableSlot in _node.h)


def _node(node_id: int) -> Node:
    return Node(node_id, None, b"", 0, 0)


def _same(table, ref: dict) -> None:
    """Every read of the mapping the code makes agrees, in the same order."""
    assert len(table) == len(ref)
    assert list(table) == list(table.keys()) == list(ref)
    assert table.values() == list(ref.values())
    assert table.items() == list(ref.items())
    for i in ref:
        assert i in table and table[i] is ref[i] and table.get(i) is ref[i]


def test_ids_in_order_removal_and_keyerror():
    table, ref = NATIVE.NodeTable(), {}
    for i in range(0, 3 * STRETCH + 5):
        table[i] = ref[i] = _node(i)
    _same(table, ref)
    for i in list(ref)[1::3] + list(range(STRETCH, 2 * STRETCH)):  # a whole stretch goes, and a third of the rest
        if i in ref:
            del table[i], ref[i]
    _same(table, ref)
    for missing in (1, STRETCH + 7, 10**6, -1, 2**63, -(2**70)):
        assert missing not in table and table.get(missing) is None and table.get(missing, "d") == "d"
        with pytest.raises(KeyError) as e:
            table[missing]
        assert e.value.args == (missing,)
    with pytest.raises(KeyError):
        del table[1]
    assert "1" not in table and table.get("1") is None and None not in table
    with pytest.raises(TypeError):
        table["1"]
    with pytest.raises(TypeError):
        table[3] = object()  # it holds native nodes only
    node = table[3]
    table[3] = replaced = _node(3)  # an id put in again replaces its node, as in a dict
    assert table[3] is replaced and len(table) == len(ref) and node is not replaced


def test_random_schedule_matches_the_dict():
    """Increasing ids made and removed at random, as a tree makes and evicts them, with an id below the
    table's lowest and one far above now and then: the same mapping after every step."""
    rng = random.Random(7)
    table, ref = NATIVE.NodeTable(), {}
    next_id = 0
    for step in range(6000):
        r = rng.random()
        if r < 0.55 or not ref:
            n = rng.randint(1, 40)
            for i in range(next_id, next_id + n):
                table[i] = ref[i] = _node(i)
            next_id += n
        elif r < 0.98:
            live = list(ref)
            for i in rng.sample(live, min(len(live), rng.randint(1, 50))):
                del table[i], ref[i]
        elif r < 0.99 and ref:
            low = min(ref) - rng.randint(1, 3 * STRETCH)  # below the lowest live id (the reference sorts it in)
            table[low] = _node(low)
            ref = dict(sorted({**ref, low: table[low]}.items()))
        else:
            far = next_id + rng.randint(STRETCH, 40 * STRETCH)
            table[far] = ref[far] = _node(far)
            next_id = far + 1
        if step % 97 == 0:
            _same(table, ref)
    _same(table, ref)


def test_memory_follows_the_live_ids():
    """Ids made and dropped oldest first (an LRU cache's order): the table's size stays that of the
    live window, not of every id made; emptied, it holds a few slots."""
    table = NATIVE.NodeTable()
    window, made = 4 * STRETCH, 200 * STRETCH
    for i in range(made):
        table[i] = _node(i)
        if i >= window:
            del table[i - window]
    live_bytes = sys.getsizeof(table)
    assert len(table) == window
    assert live_bytes < 64 * window, live_bytes  # a slot a live id at a load of 0.35-0.7; 200 * window ids were made
    for i in list(table):
        del table[i]
    assert len(table) == 0 and list(table) == [] and sys.getsizeof(table) < 1024
    table[5] = _node(5)  # an emptied table starts again wherever the next id falls
    assert list(table) == [5]


def test_memory_follows_the_live_nodes_when_their_ids_are_sparse():
    """One live id in every 10,000 of 10**7 made, the root's (0) kept throughout, the ids between made and
    dropped: the table's memory is a slot array for the 1,001 live nodes, where memory indexed by id would
    follow the 10**7 ids between the lowest and the highest (a pointer each, at least)."""
    table, node = NATIVE.NodeTable(), _node(0)
    table[0] = node
    for kept in range(10_000, 10**7 + 1, 10_000):
        for i in range(kept - 20, kept):  # the ids before it come and go (a few of the 9,999 suffice)
            table[i] = node
        for i in range(kept - 20, kept):
            del table[i]
        table[kept] = node
    assert len(table) == 1001 and list(table) == [0, *range(10_000, 10**7 + 1, 10_000)]
    assert sys.getsizeof(table) < 3 * SLOT * len(table) + 256, sys.getsizeof(table)  # a load of 0.35-0.7


def test_the_table_grows_and_shrinks_with_its_nodes():
    """100,000 nodes in, then all but every 1,000th (and the root) out: the size comes down with them,
    and the table still answers as the dict does; emptied but for the root, it is a handful of slots."""
    table, ref = NATIVE.NodeTable(), {}
    empty = sys.getsizeof(table)
    for i in range(100_000):
        table[i] = ref[i] = _node(i)
    full = sys.getsizeof(table)
    assert SLOT * len(table) < full - empty < 3 * SLOT * len(table), full  # a load of 0.35-0.7
    for i in range(100_000):
        if i % 1000:
            del table[i], ref[i]
    _same(table, ref)
    kept = sys.getsizeof(table)
    assert kept - empty < 7 * SLOT * len(table) and kept < full / 100, (kept, full)  # a load of at least 0.15
    for i in list(ref)[1:]:
        del table[i], ref[i]
    assert list(table) == [0] and sys.getsizeof(table) - empty <= 8 * SLOT  # the fewest slots it keeps
    for i in range(200_000, 203_000):  # and it grows again
        table[i] = ref[i] = _node(i)
    _same(table, ref)


def test_any_int64_ids_in_any_order():
    """Ids anywhere in int64, negative ones too, put and taken in random order, many in the same few home
    slots of a small table (removal shifts them back across the array's end): listed in ascending order."""
    rng = random.Random(11)
    table, ref = NATIVE.NodeTable(), {}
    pool = [rng.randint(-(2**63), 2**63 - 1) for _ in range(300)] + [k << 40 for k in range(-50, 50)]
    pool += [2**63 - 1 - k for k in range(20)] + [-(2**63) + k for k in range(20)]
    for step in range(20_000):
        i = rng.choice(pool)
        if i in ref and rng.random() < 0.6:
            del table[i], ref[i]
        elif i not in ref:
            table[i] = ref[i] = _node(0)
        if step % 499 == 0:
            _same(table, dict(sorted(ref.items())))
    _same(table, dict(sorted(ref.items())))


# A replay with evictions, printing each request's listing of the tree's ids (the same on both cores).
LISTINGS = textwrap.dedent(
    """
    import json
    from tpcache.core import CacheConfig, CacheCore
    from tpcache.replay import ReplayResult, replay_request
    core, result, out = CacheCore(CacheConfig(page_size=4, device_pages=64)), ReplayResult(), []
    for r in range(300):
        replay_request(core, [(r * 7 + i) % 50 for i in range(16 * (1 + (r * 3) % 5))], result)
        out.append([list(core.tree.nodes), [n.node_id for n in core.tree.nodes.values()]])
    print(json.dumps([type(core.tree.nodes).__name__, out]))
    """
)


def test_a_tree_lists_its_nodes_in_id_order_on_both_cores():
    """The dict's insertion order is id order in a tree (each node goes in when made, with the next id), so
    the reference's dict and the native table list a tree's nodes alike, through inserts and evictions."""
    runs = {}
    for name in ("reference", "native"):
        env = {**os.environ, "TPCACHE_TREE_CORE": name}
        done = subprocess.run([sys.executable, "-c", LISTINGS], env=env, capture_output=True, text=True, check=True)
        runs[name] = json.loads(done.stdout)
    assert runs["reference"][0] == "dict" and runs["native"][0] == "NodeTable"
    assert runs["reference"][1] == runs["native"][1]
    for ids, by_value in runs["native"][1]:
        assert ids == sorted(ids) == by_value and ids[0] == 0
    assert max(len(ids) for ids, _ in runs["native"][1]) > 32  # the cache filled, and evicted


def test_a_dropped_tree_frees_its_nodes():
    tree = RadixTree(4)
    parent = tree.root
    for i in range(300):
        parent = tree.add_child(parent, bytes([i % 256]) * 16, i, 0)
    nodes = tree.nodes
    tree.dispose()
    assert len(nodes) == 301 and len(tree.nodes) == 0  # the old table keeps its nodes until it goes
    assert all(n.parent is None for n in nodes.values())
