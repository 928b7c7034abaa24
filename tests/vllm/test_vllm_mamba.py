"""vLLM (CPU build) on tpcache with a Mamba hybrid, under vLLM's hybrid KV cache manager.

A random Granite-style Mamba2 hybrid (Mamba2 and attention layers interleaved), at TP=1 and TP=2,
with vLLM's prefix caching off (vLLM's CPU build runs this model only so), so that every hit is
tpcache's. vLLM then keeps one Mamba state block per request, overwritten every step; tpcache
saves it with the page that ends where a step ends (prefill chunks of one page), and a hit ends at
the last page before the prompt's last token that carries its state (``scenario.mamba_plan``):

- each prompt alone, then the batch: token-identical to plain vLLM (each prompt alone), the
  batch's hits exactly the last page boundary before each prompt's last token;
- a load that fails on one rank is recomputed;
- zeroing only the loaded Mamba state blocks changes the tokens (the negative control);
- a fresh engine hits storage (TP=1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import TP1_GROUP, TP2_GROUP
from tests.vllm.scenario import MAMBA_PAGE, MAMBA_PROMPTS, Results, mamba_plan, run_suite, total

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

# The hit of each prompt: the last page boundary before its last token
HITS = [(n - 1) // MAMBA_PAGE * MAMBA_PAGE for n in MAMBA_PROMPTS]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(1, marks=pytest.mark.xdist_group(TP1_GROUP), id="tp1"),
        pytest.param(2, marks=pytest.mark.xdist_group(TP2_GROUP), id="tp2"),
    ],
)
def mamba(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plan's engines in a driver run of their own (one per TP size)."""
    workdir = Path(tmp_path_factory.mktemp(f"vllm_mamba_tp{request.param}"))
    results: Results = run_suite({"mamba": mamba_plan(workdir / "mamba", request.param)}, workdir)["mamba"]
    return {"results": results, "tp": request.param}


def test_a_mamba_hybrid_runs_under_vllms_hybrid_allocator_with_tpcaches_page(mamba: dict[str, Any]) -> None:
    stats = mamba["results"]["conn"]["settled"]
    assert len(stats) == mamba["tp"]
    # two KV cache groups (Mamba, full attention); tpcache's page is vLLM's attention block, whose
    # size vLLM chose (it would have to change with the model, and the prompts with it)
    assert all(s["kv_groups"] == 2 and len(s["state_groups"]) == 1 for s in stats), stats
    assert all(s["page_size"] == MAMBA_PAGE for s in stats), stats


def reference(mamba: dict[str, Any]) -> list[list[int]]:
    """Plain vLLM's tokens, each prompt alone: the prefill chunks end at the same page boundaries as
    the hits' (in a batch, vLLM's own chunks of a prompt after the first end elsewhere, and bf16
    rounds those otherwise: tokens near a tie may differ)."""
    ref = mamba["results"]["ref"]
    return [ref[f"alone{i}"]["tokens"][0] for i in range(len(HITS))]


def test_a_mamba_hybrid_on_tpcache_is_token_identical(mamba: dict[str, Any]) -> None:
    conn, tokens = mamba["results"]["conn"], reference(mamba)
    assert len({tuple(t) for t in tokens}) == len(tokens)  # each prompt's own tokens change the output
    assert [conn[f"alone{i}"]["tokens"][0] for i in range(len(tokens))] == tokens
    assert conn["batch"]["tokens"] == tokens


def test_with_vllms_prefix_caching_off_every_hit_is_tpcaches_and_ends_at_a_saved_state(mamba: dict[str, Any]) -> None:
    results = mamba["results"]
    assert all(results["ref"][f"alone{i}"]["cached"] == [0] for i in range(len(HITS)))  # vLLM alone: no hit
    assert all(results["conn"][f"alone{i}"]["cached"] == [0] for i in range(len(HITS)))
    assert results["conn"]["batch"]["cached"] == HITS, HITS
    assert all(h > 0 for h in HITS)
    assert total(results["conn"]["settled"], "load_failed_blocks") == [0] * mamba["tp"]


def test_a_load_that_fails_on_one_rank_is_recomputed(mamba: dict[str, Any]) -> None:
    conn = mamba["results"]["conn"]
    assert conn["batch_failed_load"]["tokens"] == reference(mamba)
    assert conn["batch_failed_load"]["cached"] == [0, *HITS[1:]]  # the failed load's request computed it all
    failed = total(conn["settled_failed_load"], "load_failed_blocks")
    assert failed[-1] > 0, failed


def test_its_tokens_depend_on_the_loaded_mamba_states(mamba: dict[str, Any]) -> None:
    conn = mamba["results"]["conn"]
    assert conn["batch_scrambled"]["cached"] == HITS  # the loads landed (their states zeroed)
    assert conn["batch_scrambled"]["tokens"] != reference(mamba)


def test_a_fresh_engine_hits_storage_with_the_same_tokens(mamba: dict[str, Any]) -> None:
    if mamba["tp"] != 1:
        pytest.skip("storage at TP=2 is read in the Llama and Gemma 2 plans")
    fresh = mamba["results"]["fresh"]
    assert fresh["batch"]["tokens"] == reference(mamba)
    assert fresh["batch"]["cached"] == HITS
    assert total(fresh["settled"], "storage_hit_tokens") == [sum(HITS)] * mamba["tp"]  # every hit from storage
