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


@pytest.fixture
def trace_path() -> Path:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE}")
    return TRACE
