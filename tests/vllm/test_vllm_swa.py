"""vLLM (CPU build) with a sliding-window model (a tiny Mistral: every layer attends to the last two
blocks only) refuses tpcache's connector at start-up, with the reason, instead of serving wrong KV.

vLLM's sliding-window block manager frees the blocks behind a request's window while the request
runs and hands them to other requests, so a save still queued for such a block would copy another
request's KV (seen: a reused prefix gave different tokens). Plain vLLM runs the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.scenario import BLOCK, prompts, run_plan
from tpcache.testing.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("vllm")]


def plan(workdir: Path, connector: dict[str, Any] | None) -> dict[str, Any]:
    gen = {"op": "generate", "name": "batch", "prompts": prompts()["batch"], "max_tokens": 8}
    engine: dict[str, Any] = {"name": "engine", "prefix_caching": connector is None, "steps": [gen]}
    if connector is not None:
        engine["connector"] = connector
    return {
        "model": str(workdir / "model"),
        "tp": 1,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": [engine],
    }


def test_a_sliding_window_model_is_refused_by_the_connector_with_the_reason(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "model", sliding_window=2 * BLOCK)
    plain = run_plan(plan(tmp_path, None), tmp_path)
    assert len(plain["engine"]["batch"]["tokens"]) == 4  # vLLM itself runs the model
    with pytest.raises(AssertionError, match="TPCacheConnector serves full-attention models only"):
        run_plan(plan(tmp_path, {"host_pages": 64}), tmp_path)
