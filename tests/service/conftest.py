from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.harness import Service, running_service

# A metadata-only 2-rank service with a host tier, small enough that tests reach eviction.
SHARED_ARGS = ("--page-size", "4", "--device-pages", "64", "--host-pages", "128", "--heartbeat", "0.5")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("service"), *SHARED_ARGS) as svc:
        yield svc
