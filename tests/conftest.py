from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


@pytest.fixture
def trace_path() -> Path:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE}")
    return TRACE
