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

from typing import Any

import pytest

from tests.vllm.conftest import TP1_GROUP
from tests.vllm.scenario import BLOCK, REFUSAL, WINDOW, Results, total

# Both models run in the TP=1 group's driver (conftest.py), after the Llama engines.
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group(TP1_GROUP), pytest.mark.timeout(900)]


@pytest.fixture
def gemma(vllm_tp1: dict[str, Results]) -> Results:
    return vllm_tp1["gemma"]


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


def test_a_sliding_window_only_model_is_refused_by_the_connector_with_the_reason(vllm_tp1: dict[str, Results]) -> None:
    mistral = vllm_tp1["mistral"]  # a Mistral: every layer windowed
    assert mistral.error("engine") is not None, "vLLM started a sliding-window-only model with tpcache"
    assert REFUSAL in mistral.log("engine"), mistral.log("engine")[-6000:]
    assert not mistral.started("engine")  # refused at start-up, before any request
