"""vLLM (CPU build) on tpcache with sliding-window models.

- Interleaved sliding-window and full-attention layers (a tiny Gemma 2): vLLM's CPU build keeps
  every layer's blocks for the whole request (it promotes the sliding-window layers to full
  attention when its hybrid block manager is off, as it is on CPU and with a connector that does
  not declare hybrid support), so tpcache stores and loads them as full-attention pages: outputs
  are token-identical to plain vLLM, with hits from tpcache longer than the window, and a wrong
  copy changes the tokens.
- Only sliding-window layers (a tiny Mistral): vLLM frees blocks behind the window while a request
  runs, so the connector refuses the model at start-up, with the reason, instead of serving wrong KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.scenario import BLOCK, prompts, run_plan, total
from tpcache.testing.tiny_model import make_tiny_gemma2, make_tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("vllm")]

WINDOW = 2 * BLOCK


def plan(workdir: Path, engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": str(workdir / "model"),
        "tp": 1,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": engines,
    }


def generate(name: str) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": prompts()["batch"], "max_tokens": 8}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = Path(tmp_path_factory.mktemp("vllm_gemma2"))
    make_tiny_gemma2(workdir / "model", sliding_window=WINDOW)
    reset = {"op": "reset_prefix_cache"}
    conn = [
        generate("batch"),
        reset,
        generate("batch_again"),
        {"op": "settle", "name": "settled"},
        {"op": "arm", "spec": {"scramble_loads": {"rank": 0, "count": 4}}},  # negative control
        reset,
        generate("batch_scrambled"),
        {"op": "arm", "spec": {}},
        {"op": "settle", "name": "settled_scrambled"},
    ]
    engines = [
        {"name": "ref", "prefix_caching": False, "steps": [generate("batch")]},
        {"name": "conn", "connector": {"host_pages": 256}, "steps": conn},
    ]
    return run_plan(plan(workdir, engines), workdir)


def test_an_interleaved_sliding_window_model_on_tpcache_is_token_identical(gemma: dict[str, Any]) -> None:
    ref = gemma["ref"]["batch"]["tokens"]
    assert len({tuple(t) for t in ref}) == len(ref)  # each prompt's own tokens change the output
    assert gemma["conn"]["batch"]["tokens"] == ref
    assert gemma["conn"]["batch_again"]["tokens"] == ref


def test_its_prompts_hit_tpcache_past_the_window(gemma: dict[str, Any]) -> None:
    cached = gemma["conn"]["batch_again"]["cached"]  # vLLM's own cache was reset: all from tpcache
    assert all(c >= 3 * BLOCK > WINDOW and c % BLOCK == 0 for c in cached), cached
    assert total(gemma["conn"]["settled"], "loads_done_pages")[0] > 0
    assert total(gemma["conn"]["settled"], "load_failed_blocks") == [0]


def test_its_tokens_depend_on_the_loaded_kv(gemma: dict[str, Any]) -> None:
    assert gemma["conn"]["batch_scrambled"]["tokens"] != gemma["ref"]["batch"]["tokens"]


def test_a_sliding_window_only_model_is_refused_by_the_connector_with_the_reason(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "model", sliding_window=WINDOW)  # a Mistral: every layer windowed
    engines = [{"name": "engine", "connector": {"host_pages": 64}, "steps": [generate("batch")]}]
    with pytest.raises(AssertionError, match="TPCacheConnector serves full-attention models only"):
        run_plan(plan(tmp_path, engines), tmp_path)
