"""vLLM (CPU build) on tpcache at TP=1 and TP=2: token-identical to plain vLLM, hits from host and
storage, and recomputation of whatever the ranks did not agree on. Three engines per TP size, one
after another (see scenario.py), in the driver run of that size's xdist group (conftest.py); every
test reads its part of that run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import TP1_GROUP, TP2_GROUP
from tests.vllm.scenario import BLOCK, PREEMPT_TOKENS, prompts, total

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(1, marks=pytest.mark.xdist_group(TP1_GROUP), id="tp1"),
        pytest.param(2, marks=pytest.mark.xdist_group(TP2_GROUP), id="tp2"),
    ],
)
def runs(request: pytest.FixtureRequest) -> dict[str, Any]:
    tp = request.param
    out = request.getfixturevalue(f"vllm_tp{tp}")["llama"]
    out["tp"] = tp
    return out


def tokens(runs: dict[str, Any], engine: str, step: str) -> list[list[int]]:
    return runs[engine][step]["tokens"]


def test_outputs_with_the_connector_equal_plain_vllm(runs: dict[str, Any]) -> None:
    assert tokens(runs, "conn", "batch") == tokens(runs, "ref", "batch")


def test_after_reset_prefix_cache_the_prompts_hit_tpcache(runs: dict[str, Any]) -> None:
    assert tokens(runs, "conn", "batch_again") == tokens(runs, "ref", "batch")
    # vLLM's own cache was emptied: every cached token came through the connector, a full page each
    cached = runs["conn"]["batch_again"]["cached"]
    assert all(c >= 3 * BLOCK and c % BLOCK == 0 for c in cached), cached
    stats = runs["conn"]["stats_batch"]
    assert len(stats) == runs["tp"]
    hits = total(stats, "hit_tokens")
    assert hits[0] >= sum(cached) and len(set(hits)) == 1, hits  # agreed: the same on every rank


def test_multi_turn_larger_than_vllm_blocks_gets_host_hits(runs: dict[str, Any]) -> None:
    assert tokens(runs, "conn", "conversation") == tokens(runs, "ref", "conversation")
    users = prompts()["users"]
    outputs = iter(tokens(runs, "ref", "conversation"))
    history = [0] * len(users)
    for turn in range(3):
        for c in range(len(users)):
            history[c] += len(users[c][turn]) + len(next(outputs))
    assert sum(history) > 20 * BLOCK  # the working set is larger than vLLM's 20 blocks
    before = total(runs["conn"]["stats_batch"], "loads_done_pages")
    after = total(runs["conn"]["settled_conversation"], "loads_done_pages")
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    later_turns = runs["conn"]["conversation"]["cached"][len(users) :]
    assert any(c > 0 for c in later_turns)
    assert total(runs["conn"]["settled_conversation"], "host_evicted_pages") == [0] * runs["tp"]  # fits host


def test_a_fresh_vllm_on_the_same_storage_gets_storage_hits(runs: dict[str, Any]) -> None:
    assert runs["corrupted"]["fresh"] > 0
    assert tokens(runs, "fresh", "batch") == tokens(runs, "ref", "batch")
    stats = runs["fresh"]["settled"]
    storage_hits = total(stats, "storage_hit_tokens")
    assert storage_hits[0] > 0 and len(set(storage_hits)) == 1, storage_hits
    corrupt = stats[-1]["storage"]
    assert corrupt["misses_corrupt"] + corrupt["startup_discarded_corrupt"] > 0, corrupt
    # the damaged page and what follows it are recomputed on every rank; the rest came from storage
    assert runs["conn"]["batch_again"]["cached"][2:] == [4 * BLOCK, 4 * BLOCK]
    assert runs["fresh"]["batch"]["cached"] == [3 * BLOCK] * 4


def test_a_load_failing_on_one_rank_is_recomputed(runs: dict[str, Any]) -> None:
    assert tokens(runs, "conn", "batch_failed_load") == tokens(runs, "ref", "batch")
    failed = total(runs["conn"]["settled_failed_load"], "load_failed_blocks")
    assert failed[0] > 0 and len(set(failed)) == 1, failed  # every rank reported the same blocks


def test_the_tokens_depend_on_the_loaded_kv(runs: dict[str, Any]) -> None:
    # Negative control: wrong KV that nobody reports as wrong changes the output of this model.
    assert tokens(runs, "conn", "batch_scrambled") != tokens(runs, "ref", "batch")


def test_requests_aborted_while_loading_release_everything(runs: dict[str, Any]) -> None:
    settled = runs["conn"]["settled_abort"]
    assert total(settled, "leases") == [0] * runs["tp"]
    assert total(settled, "pending") == [0] * runs["tp"]
    assert tokens(runs, "conn", "batch_after_abort") == tokens(runs, "ref", "batch")


def test_a_divergence_on_one_rank_closes_then_reopens(runs: dict[str, Any]) -> None:
    if runs["tp"] == 1:
        pytest.skip("a divergence needs two ranks")
    assert tokens(runs, "conn", "other_diverged") == tokens(runs, "ref", "other")
    settled = runs["conn"]["settled_diverged"]
    assert all(s["mismatches"] for s in settled), [s["mismatches"] for s in settled]
    assert total(settled, "closed") == [0, 0]  # reopened by the agreed flush
    assert tokens(runs, "conn", "batch_after_divergence") == tokens(runs, "ref", "batch")


def test_copies_by_layer_on_a_slow_copy_thread_land_before_they_are_read_or_reused(runs: dict[str, Any]) -> None:
    """The last rank's copy thread sleeps before every layer. Its loads' blocks are zeroed when the
    load starts and compared with the host pages when ``wait_for_layer_load`` returns (before the
    attention layer reads them); its saves' host pages are zeroed when the save starts and compared
    with the blocks when ``wait_for_save`` returns (before vLLM may reuse the blocks)."""
    assert tokens(runs, "conn", "batch_delayed") == tokens(runs, "ref", "batch")
    assert all(c >= 3 * BLOCK for c in runs["conn"]["batch_delayed"]["cached"])  # loaded from tpcache
    before = [s["copies"] for s in runs["conn"]["settled_before_delay"]]
    after = [s["copies"] for s in runs["conn"]["stats_delayed"]]
    copies = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]  # this step's
    assert all(c["check_failures"] == 0 for c in copies), copies
    last = copies[-1]
    # every layer the last rank copied was checked; a forward pass waited on a load's layer
    assert last["checked_layers"] == last["layer_copies"] > 0 and last["load_layer_waits"] > 0, last
    # saves started when vLLM handed their layer over, during the forward pass, on every rank
    assert all(c["save_layers_by_hook"] > 0 for c in copies), copies


def test_nothing_stays_held(runs: dict[str, Any]) -> None:
    for engine in ("conn", "fresh"):
        settled = runs[engine]["settled"]
        assert total(settled, "leases") == [0] * runs["tp"]
        assert total(settled, "pending") == [0] * runs["tp"]


def test_a_preempted_request_loads_back_what_it_saved(runs: dict[str, Any]) -> None:
    assert tokens(runs, "conn", "preempted") == tokens(runs, "ref", "long")
    before, after = runs["conn"]["metrics_before_preemption"], runs["conn"]["metrics_preempted"]

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("vllm:num_preemptions_total") > 0, (before, after)
    preemptions = moved("vllm:tpcache_preemptions_total")
    assert preemptions > 0
    assert moved("vllm:tpcache_preempted_loaded_tokens_total") >= BLOCK
    # What a preempted request had saved comes back from tpcache: it computes again at most the
    # tokens of its last, partial page (a plain recompute would redo its prompt and more).
    assert moved("vllm:tpcache_preempted_recomputed_tokens_total") < preemptions * BLOCK
    assert len(prompts()["long"][0]) + PREEMPT_TOKENS > 5 * BLOCK


def test_tpcache_counts_reach_vllms_own_metrics(runs: dict[str, Any]) -> None:
    end = runs["conn"]["metrics_end"]
    assert end["vllm:tpcache_hit_tokens_total/host"] >= sum(runs["conn"]["batch_again"]["cached"])
    assert end["vllm:tpcache_loaded_pages_total"] > 0
    assert end["vllm:tpcache_saved_pages_total"] > 0
    assert end["vllm:tpcache_storage_written_pages_total"] > 0
    assert end["vllm:tpcache_lookups_total"] > 0
    failed = total(runs["conn"]["settled_failed_load"], "load_failed_blocks")[0]
    assert end["vllm:tpcache_failed_load_blocks_total"] >= failed > 0
    if runs["tp"] > 1:
        assert end["vllm:tpcache_closes_total"] >= 1  # the divergence
    else:
        assert end.get("vllm:tpcache_closes_total", 0) == 0
    fresh = runs["fresh"]["metrics"]
    assert fresh["vllm:tpcache_hit_tokens_total/storage"] > 0
    # "conn" loads synchronously (one KV cache group, load_mode "auto"): no request sat out of the
    # batch for its load; "fresh" loads asynchronously: each of its loads did, a step at least
    assert end.get("vllm:tpcache_load_wait_steps_total", 0) == 0
    assert fresh["vllm:tpcache_load_wait_steps_total"] > 0
    # vLLM's KV events are on in both engines: the pages tpcache named under vLLM's block hashes
    for engine, metrics in (("conn", end), ("fresh", fresh)):
        assert metrics["vllm:tpcache_event_pages_mapped_total"] > 0, engine


def test_vllm_with_the_connector_exits_within_its_grace_period(runs: dict[str, Any]) -> None:
    if runs["tp"] == 1:
        pytest.skip("checked at TP=2: the same shutdown path, and a clean exit costs seconds of garbage collection")
    log = runs.log("conn")
    assert "all workers exited gracefully" in log
    assert "force killing" not in log and "sending SIGTERM" not in log


def _tiers_from_events(events: list[dict[str, Any]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Replay vLLM's KV-event stream: per medium, the block hashes on it at the end and every one
    ever stored there. A removal must name a block the stream had stored on that medium."""
    on: dict[str, set[str]] = {}
    ever: dict[str, set[str]] = {}
    for ev in events:
        medium = ev["medium"]
        if ev["type"] == "BlockStored":
            on.setdefault(medium, set()).update(ev["hashes"])
            ever.setdefault(medium, set()).update(ev["hashes"])
        elif ev["type"] == "BlockRemoved":
            missing = set(ev["hashes"]) - on.get(medium, set())
            assert not missing or medium == "GPU", (medium, sorted(missing)[:3])  # vLLM's own: not ours to judge
            on.get(medium, set()).difference_update(ev["hashes"])
    return on, ever


def test_vllms_kv_events_carry_tpcaches_tiers_under_vllms_block_hashes(runs: dict[str, Any]) -> None:
    seen = {}
    for engine in ("conn", "fresh"):
        events = runs[engine]["kv_events"]
        _, ever = seen[engine] = _tiers_from_events(events)
        assert {ev["medium"] for ev in events} >= {"GPU", "CPU", "STORAGE"}, engine
        # Every host or storage page is a block vLLM itself stored, reported under the same hash.
        assert ever["CPU"] and ever["CPU"] <= ever["GPU"], engine
        assert ever["STORAGE"] and ever["STORAGE"] <= ever["GPU"], engine
    # The batch's prompts share three pages: on the host tier and in storage, under vLLM's hashes.
    assert len(seen["conn"][1]["CPU"] & seen["conn"][1]["STORAGE"]) >= 3
