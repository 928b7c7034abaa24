"""The ring's result reading (no vLLM here): a failed engine fails, with its error and its own part
of the log, only the tests that read it."""

from __future__ import annotations

import pytest

from tests.vllm.scenario import Results

LOG = b"first engine's log\nsecond engine: ValueError: refused\n"


def results() -> Results:
    first = {"startup_s": 1.0, "batch": {"tokens": [[5]], "cached": [0]}, "log": [0, 19]}
    second = {"error": "RuntimeError: Engine core initialization failed", "log": [19, len(LOG)]}
    return Results({"ref": first, "conn": second}, LOG)


def test_an_engine_that_ran_reads_as_its_results() -> None:
    runs = results()
    assert runs["ref"]["batch"]["tokens"] == [[5]]
    assert runs.error("ref") is None and runs.started("ref")
    assert runs.log("ref") == "first engine's log\n"


def test_reading_a_failed_engine_fails_with_its_error_and_its_log() -> None:
    runs = results()
    with pytest.raises(AssertionError, match="'conn' failed: RuntimeError: Engine core") as failure:
        runs["conn"]
    assert "second engine: ValueError: refused" in str(failure.value)
    assert "first engine's log" not in str(failure.value)
    assert runs.error("conn").startswith("RuntimeError") and not runs.started("conn")
