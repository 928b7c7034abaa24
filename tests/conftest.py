from __future__ import annotations

import os
from pathlib import Path

import pytest

from tpcache.testing import netns

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    # Mooncake's transfer engine listens on every interface; in a private network namespace that
    # is loopback only. Rank processes and servers started later inherit it. Without root this
    # does nothing, and the Mooncake tests fail saying why. TPCACHE_TEST_NETWORK=host opts out.
    if os.environ.get("TPCACHE_TEST_NETWORK", "private") == "private":
        netns.isolate()


GROUP_LOST = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # On an xdist worker under --dist loadgroup, xdist has by now suffixed each grouped test's id
    # with "@group"; the scheduler groups by that suffix alone. Where it is missing (pytest-xdist
    # 3.8 on pytest 9.2: pytest-dev/pytest-xdist#1386) the groups are spread over both workers and
    # each worker would run the whole vLLM ring: those tests fail at once instead (see below).
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[GROUP_LOST] = (
                "pytest-xdist's --dist loadgroup does not group tests on this pytest (the test's id has "
                "no @group suffix), so the tests of this group would run on every worker: install the "
                "pytest that pyproject.toml's test extra allows (make setup)"
            )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if GROUP_LOST in item.stash:  # before its fixtures start anything
        pytest.fail(item.stash[GROUP_LOST], pytrace=False)


@pytest.fixture
def trace_path() -> Path:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE}")
    return TRACE
