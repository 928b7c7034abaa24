"""The page hash of inputs over 240 bytes in C (``_account.c``'s ``xxh3_long``, which ``_chain.c``
uses for pages of 59 to 1022 tokens) against the xxhash package, on the vector path this machine
runs and on the portable one."""

from __future__ import annotations

import random

import pytest
import xxhash

from tpcache.core import CacheConfig, CacheCore, hashing
from tpcache.core.tree import NATIVE_NODES

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core._node was not built (no C compiler)")

if NATIVE_NODES:
    from tpcache.core import _node

# Around every boundary of the algorithm: a stripe (64), a block (1024), the last stripe's overlap.
LENGTHS = [*range(241, 330), *range(1020, 1100), 2048, 2056, 2057, 3071, 3072, 3073, 4104, 10000]


@pytest.mark.parametrize("portable", [False, True])
def test_xxh3_long_matches_the_xxhash_package(portable):
    rng = random.Random(7)
    for n in LENGTHS:
        for seed in (0, 1, (1 << 64) - 1, rng.getrandbits(64)):
            data = rng.randbytes(n)
            assert _node.xxh3_long(data, seed, portable) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)
    with pytest.raises(ValueError, match="more than 240"):
        _node.xxh3_long(b"x" * 240, 0)


@pytest.mark.parametrize("page_size", [58, 59, 512, 1022, 1023])
def test_the_chain_hashes_pages_as_the_reference(page_size):
    """Pages of 59-1022 tokens hash in C, the others through the package: the node hashes of an
    inserted chain are ``hashing.hash_chain``'s either way."""
    core = CacheCore(CacheConfig(page_size=page_size, device_pages=8))
    tokens = list(range(3 * page_size))
    lease, _ = core.lock(tokens)
    core.insert(lease, tokens, core.alloc(lease, 3))
    nodes = sorted((n for n in core.tree.nodes.values() if n.parent is not None), key=lambda n: n.depth)
    expected = hashing.hash_chain(hashing.as_token_bytes(tokens), page_size, core.tree.namespace)
    assert [n.hash for n in nodes] == expected
