"""Real store servers for the store tests, started once per test session (on one xdist worker:
the tests are grouped). A server that cannot start fails the tests that need it, with why."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tpcache.testing.servers import MooncakeStore, RedisServer, ServerError

BACKENDS = ("mooncake", "redis")
# Test pages are smaller than the Mooncake backend's direct thresholds; 0 puts every writable page
# (the host pool's, a bytearray) from the caller's memory and reads every page into it, the path
# large pages take without a deadline (deadline=0; with one, reads go through the staging buffer).
MOONCAKE_DIRECT = "&direct_put=0&direct_get=0&deadline=0"


def _started(server: MooncakeStore | RedisServer) -> MooncakeStore | RedisServer:
    try:
        return server.start()
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    try:
        store = MooncakeStore(tmp_path_factory.mktemp("mooncake"))
    except (ServerError, RuntimeError) as exc:
        pytest.fail(f"cannot start a Mooncake Store: {exc}", pytrace=False)
    _started(store)
    yield store
    store.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis"))
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    _started(server)
    yield server
    server.stop()


def store_url(request: pytest.FixtureRequest, backend: str) -> str:
    """The URL of the session's server for ``backend`` (started on first use)."""
    name = {"mooncake": "mooncake_store", "redis": "redis_server"}[backend]
    url = request.getfixturevalue(name).url
    return url + MOONCAKE_DIRECT if backend == "mooncake" else url


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    """A namespace of this test's own: tests share a server, never each other's pages."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:90]
