"""The shared storage layout on Mooncake Store and redis-server: a TP=2 group's pages read by TP=1,
TP=4 and PP2xTP1 groups, and a shard removed from the store a miss on every rank of every shape."""

from __future__ import annotations

import pytest

from tests.storage.test_storage_sharded import cross_shape
from tests.store.conftest import BACKENDS, store_url
from tpcache.io.storage import StorageKey
from tpcache.io.storage.url import _open, parse_storage_url

pytestmark = [pytest.mark.xdist_group("store")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pages_of_one_shape_are_read_by_others_and_a_removed_shard_misses_everywhere(
    request: pytest.FixtureRequest, backend: str, namespace: str
) -> None:
    url = store_url(request, backend)

    def remove(key: StorageKey) -> int:
        store = _open(parse_storage_url(url), None, 1 << 20)  # type: ignore[arg-type]
        try:
            return sum(store.delete([key]))
        finally:
            store.close()

    cross_shape(url, remove, model_id=namespace)
