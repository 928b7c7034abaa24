"""vLLM (CPU build) on tpcache with sliding-window models, under vLLM's hybrid KV cache manager.

The connector declares hybrid support, so vLLM keeps its hybrid allocator on: each KV cache group
(full attention, sliding window) has its own block table, and vLLM frees a sliding-window group's
blocks behind the window while a request runs. A tpcache page holds one block of every group.

- Interleaved sliding-window and full-attention layers (a tiny Gemma 2), at TP=1 and TP=2, with
  vLLM's prefix caching on: token-identical to plain vLLM; after ``reset_prefix_cache`` every hit
  is tpcache's, longer than the window; a load that fails on one rank is recomputed; zeroing only
  the sliding-window blocks a load wrote changes the tokens; multi-turn histories, whose pages
  computed while decoding lost their window blocks in vLLM, come back from tpcache; a fresh
  engine hits storage.
- Only sliding-window layers (a tiny Mistral, TP=1): one group, whose leading pages of a hit vLLM
  no longer holds: token-identical, hits past the window.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import TP1_GROUP, TP2_GROUP
from tests.vllm.scenario import BLOCK, WINDOW, total

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(1, marks=pytest.mark.xdist_group(TP1_GROUP), id="tp1"),
        pytest.param(2, marks=pytest.mark.xdist_group(TP2_GROUP), id="tp2"),
    ],
)
def gemma(request: pytest.FixtureRequest) -> dict[str, Any]:
    out = request.getfixturevalue(f"vllm_tp{request.param}")["gemma"]
    out["tp"] = request.param
    return out


def test_an_interleaved_sliding_window_model_runs_under_vllms_hybrid_allocator(gemma: dict[str, Any]) -> None:
    stats = gemma["conn"]["settled"]
    assert len(stats) == gemma["tp"]
    # two KV cache groups (full attention, sliding window): vLLM's hybrid allocator was on
    assert all(s["kv_groups"] == 2 and len(s["sliding_groups"]) == 1 for s in stats), stats


def test_an_interleaved_sliding_window_model_on_tpcache_is_token_identical(gemma: dict[str, Any]) -> None:
    ref = gemma["ref"]["batch"]["tokens"]
    assert len({tuple(t) for t in ref}) == len(ref)  # each prompt's own tokens change the output
    assert gemma["conn"]["batch"]["tokens"] == ref
    assert gemma["conn"]["batch_again"]["tokens"] == ref


def test_its_prompts_hit_tpcache_past_the_window(gemma: dict[str, Any]) -> None:
    cached = gemma["conn"]["batch_again"]["cached"]  # vLLM's own cache was reset: all from tpcache
    assert all(c >= 3 * BLOCK > WINDOW and c % BLOCK == 0 for c in cached), cached
    assert total(gemma["conn"]["settled"], "loads_done_pages")[0] > 0
    assert total(gemma["conn"]["settled"], "load_failed_blocks") == [0] * gemma["tp"]


def test_a_load_that_fails_on_one_rank_is_recomputed(gemma: dict[str, Any]) -> None:
    assert gemma["conn"]["batch_failed_load"]["tokens"] == gemma["ref"]["batch"]["tokens"]
    failed = total(gemma["conn"]["settled_failed_load"], "load_failed_blocks")
    assert failed[-1] > 0, failed  # the last rank's load failed, and vLLM computed the prompt again


def test_its_tokens_depend_on_the_loaded_sliding_window_blocks(gemma: dict[str, Any]) -> None:
    assert gemma["conn"]["batch_scrambled"]["tokens"] != gemma["ref"]["batch"]["tokens"]


def test_multi_turn_histories_decoded_past_the_window_come_back_from_tpcache(gemma: dict[str, Any]) -> None:
    conv = gemma["conn"]["conversation"]
    assert conv["tokens"] == gemma["ref"]["conversation"]["tokens"]
    # turns 2 and 3 (four conversations each): vLLM's own cache was emptied before each turn, so
    # every cached token is tpcache's; turn 3's hits cover pages computed while decoding turn 2
    second, third = conv["cached"][4:8], conv["cached"][8:]
    assert all(c >= 2 * BLOCK and c % BLOCK == 0 for c in second), conv["cached"]
    assert all(c >= 2 * WINDOW and c % BLOCK == 0 for c in third), conv["cached"]
    assert total(gemma["conn"]["settled_conversation"], "load_failed_blocks") == total(
        gemma["conn"]["settled_failed_load"], "load_failed_blocks"
    )


def test_a_fresh_engine_hits_storage_with_the_same_tokens(gemma: dict[str, Any]) -> None:
    fresh = gemma["fresh"]["batch"]
    assert fresh["tokens"] == gemma["ref"]["batch"]["tokens"]
    assert all(c >= 3 * BLOCK for c in fresh["cached"]), fresh["cached"]
    assert total(gemma["fresh"]["settled"], "storage_hit_tokens")[0] > 0


@pytest.mark.xdist_group(TP1_GROUP)
def test_a_sliding_window_only_model_is_token_identical_with_hits_past_the_window(vllm_tp1: dict[str, Any]) -> None:
    mistral = vllm_tp1["mistral"]  # a Mistral: every layer windowed
    ref = mistral["ref"]["batch"]["tokens"]
    assert mistral["conn"]["batch"]["tokens"] == ref
    assert mistral["conn"]["batch_again"]["tokens"] == ref
    cached = mistral["conn"]["batch_again"]["cached"]
    assert all(c >= 3 * BLOCK > WINDOW for c in cached), cached
    assert mistral["conn"]["settled"][0]["sliding_groups"] == [0]  # its one group is windowed
