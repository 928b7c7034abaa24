"""The shard layout's native path (records gathered and checked in C) on Mooncake Store and
redis-server: what it writes the Python path reads byte-exact and back, a damaged or missing shard
is a miss of its page, and with a storage key the MAC is checked (the Python path)."""

from __future__ import annotations

import pytest
import torch

from tests.store.conftest import BACKENDS, store_url
from tpcache.comm.parallel import Shard
from tpcache.core.backend import RECORD
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import StorageKey, remote
from tpcache.io.storage.record import encode_header, payload_checksum
from tpcache.io.storage.sharded import ModelShape, ShardedStorage, open_shared_storage

pytestmark = [
    pytest.mark.xdist_group("store"),
    pytest.mark.skipif(RECORD is None, reason="the native record code is not built here (reference core)"),
]

LAYOUT = KVLayout.from_model(4, 4, 8, 1, torch.float16, 4)  # 4 layers x 4 KV heads: 4 shards a page


def opened(url: str, model_id: str, storage_key: bytes | None = None) -> ShardedStorage:
    model = ModelShape.of_rank(model_id, LAYOUT, Shard(0, 1), layers_per_shard=4)
    return open_shared_storage(url, model=model, shard=Shard(0, 1), layout=LAYOUT, storage_key=storage_key)


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys(n: int, first: int) -> list[StorageKey]:
    return [StorageKey("rank-key", 1, 0, 1, first + i) for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_native_and_python_paths_read_each_others_pages_and_a_bad_shard_misses_its_page(
    request: pytest.FixtureRequest, backend: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = store_url(request, backend)
    store = opened(url, namespace)
    try:
        assert store._native_for() is not None
        native_pages, python_pages = pages(3, 1), pages(3, 2)
        assert store.put(keys(3, 0), native_pages) == [True] * 3
        with monkeypatch.context() as m:  # the Python path: split, encode_header, check_value, assemble
            m.setattr(remote, "_native", None)
            assert store._native_for() is None
            assert store.put(keys(3, 10), python_pages) == [True] * 3
            out = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8) for _ in range(3)]
            assert store.get(keys(3, 0), out) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(out, native_pages, strict=True))
        out = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8) for _ in range(3)]
        assert store.get(keys(3, 10), out) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(out, python_pages, strict=True))

        # Page 0: its third shard's payload damaged under a header that names it; page 1: a shard gone.
        inner = store._inner
        shard = store.shard_keys(keys(1, 0)[0])[2]
        echo = shard.encode().encode("ascii")
        bad = bytearray(store.model.shard_bytes)
        with inner._lock:
            head = encode_header(echo, 0, len(bad), payload_checksum(bytes(bad)))
            bad[5] ^= 1
            assert inner._put(inner._names([echo]), [head], [memoryview(bad)]) == [None]
        assert inner.delete([store.shard_keys(keys(2, 0)[1])[1]]) == [True]
        before = store.stats()
        out = [torch.full((LAYOUT.page_bytes,), 7, dtype=torch.uint8) for _ in range(3)]
        assert store.get(keys(3, 0), out) == [False, False, True]
        assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1]) == 0  # no partial set left
        assert torch.equal(out[2], native_pages[2])
        after = store.stats()
        grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert grew["misses_corrupt"] == 1 and grew["misses_missing"] == 1 and grew["page_partial"] == 2
        assert grew["hits"] == 10 and grew["page_hits"] == 1
        # Written again, a damaged or lost shard is replaced (the store keeps the last write).
        assert store.put(keys(2, 0), native_pages[:2]) == [True, True]
        again = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8) for _ in range(2)]
        assert store.get(keys(2, 0), again) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(again, native_pages, strict=False))
    finally:
        store.close()

    keyed = opened(url, namespace, storage_key=b"k" * 32)
    try:  # a reader with a storage key checks MACs in Python: records written without one are misses
        assert keyed._native_for() is None
        out = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8)]
        assert keyed.get(keys(1, 2), out) == [False]
        assert keyed.stats()["misses_unauthenticated"] >= 1
        assert keyed.put(keys(1, 20), pages(1, 3)) == [True]
        assert keyed.get(keys(1, 20), out) == [True] and torch.equal(out[0], pages(1, 3)[0])
    finally:
        keyed.close()
