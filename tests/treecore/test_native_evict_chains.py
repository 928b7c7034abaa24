"""Eviction of whole chains in C (``_evict.c``: a dropped leaf's parent that is the next pop is
dropped without its push and pop) against the Python reference loop, in lockstep on a pool that
every request overflows by several pages, as a trace replay does.

The heaps are compared as multisets: the C loop leaves the entries the reference leaves, but a
push followed by a pop may leave heapq's list in another order, which no pop can tell apart."""

from __future__ import annotations

import random
from array import array

import pytest

from tpcache.core import CacheConfig, CacheCore, check
from tpcache.core.treecore import eviction
from tpcache.core.treecore.tree import NATIVE_NODES
from tpcache.replay import ReplayResult, replay_request
from tpcache.testing.sim import snapshot

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")

PAGE = 4


def conversations(seed: int, n: int) -> list[array]:
    """Requests that continue an earlier one (a shared prefix and new pages) or start anew."""
    rng = random.Random(seed)
    made: list[array] = []
    for i in range(n):
        base = rng.choice(made)[: rng.randrange(0, 9) * PAGE] if made and rng.random() < 0.6 else array("i")
        new = array("i", [i * 1000 + k for k in range(rng.randrange(1, 12) * PAGE + rng.randrange(PAGE))])
        made.append(base + new)
    return made


def heaps(core: CacheCore) -> tuple[list[int], list[int]]:
    return sorted(core.candidates.device_heap), sorted(core.candidates.host_heap)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("seed", range(3))
def test_chain_eviction_matches_the_reference_loop(policy, seed, monkeypatch):
    config = CacheConfig(page_size=PAGE, device_pages=24, eviction_policy=policy, write_policy="none")
    cores = CacheCore(config), CacheCore(config)
    results = ReplayResult(), ReplayResult()
    for step, tokens in enumerate(conversations(seed, 160)):
        for native, core, result in zip((True, False), cores, results, strict=True):
            with monkeypatch.context() as m:
                if not native:
                    m.setattr(eviction, "_native", None)
                replay_request(core, tokens, result)
        a, b = cores
        assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value, f"step {step}"
        assert a.device._free == b.device._free and heaps(a) == heaps(b), f"step {step}"
    assert results[0] == results[1]
    assert a.stats.device_evicted_pages == b.stats.device_evicted_pages > 200
    check(a)
    check(b)
    popped = [], []
    for core, out in zip(cores, popped, strict=True):
        while (node := core.candidates.pop_device()) is not None:
            out.append(node.node_id)
    assert popped[0] == popped[1] and popped[0]
