"""The page hashes of the native core are xxHash's own XXH3 (``_hash.h``: the library's header,
inlined), on the stack up to 4,096 bytes and streamed past it: the node hashes of an inserted chain
are ``hashing.hash_chain``'s (the xxhash package) for every length branch of the algorithm."""

from __future__ import annotations

import pytest

from tpcache.core import CacheConfig, CacheCore, hashing
from tpcache.core.treecore.tree import NATIVE_NODES

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")


# Inputs of 8 + 4 x page_size bytes: 12 (4-8), 16 (9-16), 24-128, 132-240, longer, and past 4 KiB
# (several blocks of stripes).
@pytest.mark.parametrize("page_size", [1, 2, 4, 30, 31, 58, 59, 512, 1022, 1023, 1030])
@pytest.mark.parametrize("namespace", ["", "model-a"])
def test_the_chain_hashes_pages_as_the_reference(page_size, namespace):
    core = CacheCore(CacheConfig(page_size=page_size, device_pages=8, namespace=namespace))
    tokens = list(range(3 * page_size))
    lease, _ = core.lock(tokens)
    core.insert(lease, tokens, core.alloc(lease, 3))
    nodes = sorted((n for n in core.tree.nodes.values() if n.parent is not None), key=lambda n: n.depth)
    expected = hashing.hash_chain(hashing.as_token_bytes(tokens), page_size, core.tree.namespace)
    assert [n.hash for n in nodes] == expected
