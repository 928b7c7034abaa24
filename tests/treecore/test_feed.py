"""The change feed (``tpcache/core/treecore/feed.py``): what the ledger and the C kernels change on each tier
adds up, drain after drain, to the pages the tree holds on each tier. The simulator checks this on
every rank after every round of every schedule (``SimCluster.check``); these tests run schedules
with and without the C extension and pin the feed's own promises."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tpcache.core import CacheConfig, CacheCore
from tpcache.core.hashing import as_token_bytes, hash_chain
from tpcache.core.treecore.feed import ChangeFeed, apply_changes, on_tiers
from tpcache.replay import drain as replay_drain
from tpcache.testing import sim

REPO = Path(__file__).resolve().parents[2]
P = 4


def put(core: CacheCore, tokens: list[int]) -> None:
    lease, m = core.lock(tokens)
    fresh = core.alloc(lease, len(m.page_hashes) - m.device_pages)
    core.insert(lease, tokens, m.device_page_ids + fresh)
    core.release(lease)


def test_a_cache_has_no_feed_unless_one_is_attached():
    assert CacheCore(CacheConfig(page_size=P, device_pages=8)).ledger.feed is None


def test_drains_add_up_to_the_tiers_with_evictions_a_host_tier_and_storage():
    core = CacheCore(CacheConfig(page_size=P, device_pages=6, host_pages=8, write_policy="write_through", storage=True))
    core.ledger.feed = feed = ChangeFeed()
    mirror: tuple[set[int], set[int], set[int]] = (set(), set(), set())
    seen_tiers = [0, 0, 0]
    for i in range(12):
        put(core, [i % 5 * 100 + t for t in range(3 * P)])
        replay_drain(core)  # the copies land and the round's commit applies them
        changes = feed.drain()
        for tier in range(3):
            seen_tiers[tier] += len(changes.stored[tier]) + len(changes.removed[tier])
        apply_changes(mirror, changes)
        assert mirror == on_tiers(core.tree.nodes.values())
    assert all(seen_tiers), seen_tiers  # every tier stored and removed pages on the way
    first = hash_chain(as_token_bytes([100 + t for t in range(3 * P)]), P, "")
    assert set(first) <= mirror[0] | mirror[1]  # the last request: the hashes are the documented page hashes


def test_a_flush_drains_as_cleared_then_only_what_follows():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8))
    core.ledger.feed = feed = ChangeFeed()
    put(core, list(range(2 * P)))
    assert len(feed.drain().stored[0]) == 2
    core.reset(next_op=100, next_lease=100)
    put(core, list(range(50, 50 + P)))
    changes = feed.drain()
    assert changes.cleared and changes.removed == ([], [], []) and len(changes.stored[0]) == 1
    assert not feed.drain()  # nothing since


def test_a_page_stored_and_removed_between_drains_is_in_neither_list():
    core = CacheCore(CacheConfig(page_size=P, device_pages=2, write_policy="none"))
    core.ledger.feed = feed = ChangeFeed()
    put(core, list(range(2 * P)))
    core.evict_device(2)
    assert not feed.drain()


def test_seeded_schedules_keep_every_feed_equal_to_its_tree(caplog):
    caplog.set_level(logging.CRITICAL)
    for seed in range(40):
        sim.run_schedule(seed, 2)
    for seed in range(3):
        sim.run_schedule(seed, 3, hybrid="both")
        sim.run_schedule(seed, 2, buffer=True)


WITHOUT_EXTENSION = textwrap.dedent(
    """
    import json, logging, sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "tpcache.core.treecore._node":
                raise ImportError("blocked: the reference path")
    sys.meta_path.insert(0, Block())
    logging.disable(logging.CRITICAL)
    from tpcache.core.treecore.tree import NATIVE_NODES
    from tpcache.testing import sim
    for seed in range(30):
        sim.run_schedule(seed, 2)
    sim.run_schedule(1, 3, hybrid="both")
    print(json.dumps({"native": NATIVE_NODES}))
    """
)


def test_seeded_schedules_without_the_extension_keep_every_feed_equal_to_its_tree():
    env = {k: v for k, v in os.environ.items() if k != "TPCACHE_TREE_CORE"}  # unset: the reference where not built
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTENSION], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"native": False}
