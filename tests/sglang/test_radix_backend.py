"""``--radix-cache-backend tpcache`` with real SGLang 0.5.23 engines on CPU (TP=1 and TP=2): SGLang's
KV pool as tpcache's device tier, one tpcache rank per TP scheduler.

The same prompts go to plain SGLang (its own radix cache) and to SGLang with tpcache's backend and
a host tier: a prompt, one sharing its first two pages, the first again, then a flood of other
prompts larger than the KV pool (so the cache must evict and hand pages back to SGLang's allocator),
the first two prompts again (plain SGLang evicted them; tpcache loads them back from its host tier),
and a last prompt twice (at TP=1 its second run hits: the cache stayed open through every round; at
TP=2 rank 1 is made to apply one operation rank 0 does not when it caches that prompt, and the
second run misses: the round closed the cache); then SGLang flushes its cache, which empties both
tiers and reopens it, and the same prompts run again, then the first prompt with cache salts. At
TP=2 rank 1's scheduler then SIGKILLs itself mid-step, and rank 0's round ends the engine with an
error naming it. Every prompt's tokens are the same in both engines; tpcache serves the prefix hits
SGLang's own cache serves, and after the flood those its host tier kept. Both engines run SGLang's
strict memory checks after every step, which hold the cache's evictable and protected sizes
against SGLang's allocator.

tpcache's engine also writes a file store (``TPCACHE_SGLANG_STORAGE``), and a fresh engine on
that store gets the flood prompts submitted together, one running at a time: the queued ones are
served from storage (read to host while they wait, loaded back at admission), with plain SGLang's
tokens on the same prompts submitted the same way.

SGLang finds the backend through tpcache's ``sglang.srt.plugins`` entry point (pyproject.toml).
The venv's tpcache may have been installed before that entry point existed, so the test puts a
``tpcache`` dist-info made from pyproject.toml's entry points ahead of it on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed here: the SGLang ring runs in .venv-sglang (make setup-sglang)",
        allow_module_level=True,
    )

from tests.sglang import engines
from tpcache.integrations.sglang.options import parse_faults, parse_host_pages, parse_storage, refusal
from tpcache.testing.tiny_model import make_tiny_llama

PAGE = 16
POOL_TOKENS = 512  # 32 pages: the flood below needs more, so the cache must evict
HOST_PAGES = 128  # tpcache's host tier: every page the prompts below cache fits
# SGLang's own checks, after every scheduler step: free + evictable + protected + held by requests
# == the pool (the cache's sizes against SGLang's allocator), and no page both free and in use.
# When idle: the same without requests, as an error instead of a warning.
STRICT_CHECKS = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}


def _prompts() -> list[list[int]]:
    first = [(7 * j + 13) % 500 + 3 for j in range(70)]
    sharing = first[:40] + [(11 * j + 5) % 500 + 3 for j in range(30)]
    flood = [[(17 * i + 29 * j + 1) % 500 + 3 for j in range(70)] for i in range(1, 9)]
    return [first, sharing, first, *flood, first, sharing, LAST, LAST]


LAST = [(5 * j + 2) % 500 + 3 for j in range(70)]
AFTER_FLOOD = 11  # the first prompt again after the flood, then the one sharing its first pages
KILL = [1, *LAST[1:]]  # the only prompt starting with token 1


def run_engine(workdir: Path, name: str, spec: dict, ends_in_error: bool = False, **env_more: str) -> dict:
    """An engine with tpcache's plugin entry point on its path and SGLang's strict checks on."""
    return engines.run_engine(
        workdir,
        name,
        spec,
        path=[engines.plugin_dist(workdir / name)],
        env={**STRICT_CHECKS, **env_more},
        ends_in_error=ends_in_error,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("sglang_radix_model")))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict:
    workdir = Path(tmp_path_factory.mktemp(f"sglang_radix_tp{request.param}"))
    spec = {
        "model": str(model),
        "tp": request.param,
        "page_size": PAGE,
        "cache": "radix",
        "max_total_tokens": POOL_TOKENS,
        "prompts": _prompts(),
        "max_new_tokens": 8,
        "second_pass": True,
        # Then the first prompt with cache salts: "a", "b", "a" again, and none.
        "salted": [[_prompts()[0], salt] for salt in ("a", "b", "a", None)],
    }
    store = workdir / "store"
    # Plain SGLang also serves the flood prompts submitted together, one running at a time,
    # after an empty cache: what it gets alone on the steps a fresh engine on tpcache's store runs.
    together = {"together": _prompts()[3:AFTER_FLOOD], "max_running_requests": 1}
    plain = run_engine(workdir, "plain", {**spec, **together})["passes"]
    # At TP=2, rank 1 diverges once, when it caches the last prompt (the only one starting with
    # its first token): the round that follows must close the cache on both ranks. After both
    # passes, rank 1's scheduler SIGKILLs itself while it caches one more prompt, mid-step: rank 0's
    # round must end the engine with an error naming rank 1.
    faults = {"diverge": {"rank": 1, "first_token": LAST[0]}, "kill": {"rank": 1, "first_token": KILL[0]}}
    tp2 = request.param == 2
    ours = run_engine(
        workdir,
        "tpcache",
        {**spec, "radix_backend": "tpcache", "store_dir": str(store), **({"last_prompt": KILL} if tp2 else {})},
        ends_in_error=tp2,
        TPCACHE_SGLANG_FAULTS=json.dumps(faults) if tp2 else "",
        TPCACHE_SGLANG_HOST_PAGES=str(HOST_PAGES),
        TPCACHE_SGLANG_STORAGE=str(store),
    )
    log = (workdir / "tpcache.log").read_text(errors="replace")
    return {
        "log": log,
        "exit_code": ours.get("exit_code"),
        "tp": request.param,
        "plain": plain[0],
        "tpcache": ours["passes"][0],
        "plain_again": plain[1],
        "tpcache_again": ours["passes"][1],
        "plain_salted": plain[2],
        "tpcache_salted": ours["passes"][2],
        "plain_together": plain[3],
        "workdir": workdir,
        "store": store,
        "spec": spec,
        "fault_fired": log.count("test fault: this rank applies an operation the others do not"),
    }


def test_tokens_are_the_same_as_plain_sglangs(served: dict) -> None:
    assert served["tpcache"]["outputs"] == served["plain"]["outputs"]


def test_prefix_hits_are_served_from_sglangs_pool(served: dict) -> None:
    hits = [c["total"] for c in served["tpcache"]["cached"]]
    plain = [c["total"] for c in served["plain"]["cached"]]
    # The second prompt shares two full pages with the first; the first again hits all of its
    # full pages but the one holding its last token's successor (SGLang matches at most len - 1).
    assert hits[:3] == plain[:3] == [0, 2 * PAGE, 4 * PAGE]
    assert hits[3:AFTER_FLOOD] == plain[3:AFTER_FLOOD] == [0] * 8  # the flood: new prompts
    assert plain[-2:] == [0, 4 * PAGE]
    if served["tp"] == 1:
        # The last prompt's second run hits: the cache stayed open through every round.
        assert hits[-2:] == [0, 4 * PAGE]


def test_after_a_flood_the_first_prompts_are_served_from_the_host_tier(served: dict) -> None:
    hits = [c["total"] for c in served["tpcache"]["cached"]][AFTER_FLOOD : AFTER_FLOOD + 2]
    plain = [c["total"] for c in served["plain"]["cached"]][AFTER_FLOOD : AFTER_FLOOD + 2]
    # The flood (8 prompts of 5 pages into a 32-page pool) made both caches evict the first two
    # prompts' pages from SGLang's pool. Plain SGLang computes the first prompt again (and the
    # second then hits the two pages the first put back); tpcache kept every page on host and
    # loads them back into SGLang's pool: both hit all their full pages but the last token's.
    assert plain[0] < PAGE and plain[1] <= 2 * PAGE
    assert hits == [4 * PAGE, 4 * PAGE]
    # SGLang counts what came from the host tier: all of the first prompt's hit; of the second,
    # the two pages past those the first prompt's load put back in SGLang's pool.
    host = [c["host"] for c in served["tpcache"]["cached"]][AFTER_FLOOD : AFTER_FLOOD + 2]
    assert host == [4 * PAGE, 2 * PAGE]
    # Beyond what SGLang alone gets on the same steps, with the same tokens (checked above).
    assert hits[0] - plain[0] > 3 * PAGE and hits[1] - plain[1] >= 2 * PAGE


def test_a_divergence_on_one_rank_closes_the_cache_and_tokens_stay_the_same(served: dict) -> None:
    if served["tp"] == 1:
        pytest.skip("one rank cannot disagree with itself")
    assert served["fault_fired"] == 1
    # Rank 1 applied an operation rank 0 did not while caching the last prompt: the next round
    # closed the cache on both ranks, so the last prompt's second run is a miss (plain SGLang
    # hits it) and computes the same tokens.
    assert [c["total"] for c in served["tpcache"]["cached"]][-1] == 0
    assert served["tpcache"]["outputs"] == served["plain"]["outputs"]


def test_sglangs_flush_empties_the_cache_and_it_fills_again(served: dict) -> None:
    # SGLang's flush_cache is an agreed flush of tpcache's ranks, which empties its device and host
    # tiers (at TP=2 it reopens the cache the divergence closed): the prompts served again hit
    # as in the first pass, the last one's second run included, with the same tokens.
    again = served["tpcache_again"]
    assert again["outputs"] == served["tpcache"]["outputs"]
    first = [c["total"] for c in served["tpcache"]["cached"]]
    assert [c["total"] for c in again["cached"]] == [*first[:-1], 4 * PAGE]
    assert again["cached"][0]["total"] == 0


def test_a_cache_salt_shares_pages_only_with_the_same_salt(served: dict) -> None:
    # The first prompt is cached without a salt; with salt "a" it misses, with "b" it misses again,
    # with "a" again it hits the pages cached under "a", and without a salt it hits its own pages.
    hits = [c["total"] for c in served["tpcache_salted"]["cached"]]
    assert hits == [c["total"] for c in served["plain_salted"]["cached"]] == [0, 0, 4 * PAGE, 4 * PAGE]
    assert served["tpcache_salted"]["outputs"] == [served["plain"]["outputs"][0]] * 4


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(served: dict) -> None:
    if served["tp"] == 1:
        pytest.skip("no other rank to lose")
    # Rank 1's scheduler SIGKILLed itself mid-step, after both passes; rank 0's round found its
    # process gone, and the error it raised made SGLang stop the engine (no hang: the driver would
    # have timed out instead). The error is one line and names rank 1 and its pid.
    pids = re.findall(r"test fault: TP scheduler pid (\d+) kills itself", served["log"])
    assert len(pids) == 1
    assert served["exit_code"] != 0
    lines = [line for line in served["log"].splitlines() if "GroupBroken: tpcache: a TP rank died" in line]
    assert lines and all(f"rank(s) [1] will not arrive (rank 1 (pid {pids[0]}) exited)" in line for line in lines)
    assert "restart the engine" in lines[-1]


def test_a_fresh_engine_on_the_same_store_serves_queued_prompts_from_storage(served: dict) -> None:
    # The first engine wrote every page it backed up to host to its file store too. A fresh engine
    # on that store gets the flood prompts together, one running at a time: while one runs, the
    # backend's storage prefetch (started when SGLang matched the queued prompts) reads theirs to
    # host, and each is then admitted with its pages loaded back; plain SGLang computes them all.
    flood = _prompts()[3:AFTER_FLOOD]
    spec = {**served["spec"], "radix_backend": "tpcache", "prompts": [], "second_pass": False, "salted": None}
    fresh = run_engine(
        served["workdir"],
        "fresh",
        {**spec, "together": flood, "max_running_requests": 1},
        TPCACHE_SGLANG_HOST_PAGES=str(HOST_PAGES),
        TPCACHE_SGLANG_STORAGE=str(served["store"]),
    )["passes"][-1]
    plain = served["plain_together"]
    assert fresh["outputs"] == plain["outputs"]
    hits = [c["total"] for c in fresh["cached"]]
    base = [c["total"] for c in plain["cached"]]
    assert base == [0] * len(flood)  # distinct prompts: plain SGLang computes every one
    # The first is admitted at once (nothing read yet); the second may be too, if it reached the
    # scheduler after the first was admitted. Every later one waited while its pages were read from
    # the store and is served all its full pages but the last token's, loaded back from host.
    assert hits[0] == 0 and hits[1] in (0, 4 * PAGE), hits
    assert hits[2:] == [4 * PAGE] * (len(flood) - 2), hits
    assert [c["host"] for c in fresh["cached"]] == hits


def test_what_the_backend_cannot_serve_is_refused_in_one_line() -> None:
    ok = {"hybrid_swa": False, "hybrid_ssm": False, "page_size": 16, "eagle": False, "hicache": False}
    ok.update(disabled=False, eviction_policy="lru")
    assert refusal(**ok) is None
    for change, words in [
        ({"hybrid_swa": True}, "sliding-window layers"),
        ({"hybrid_ssm": True}, "Mamba layers"),
        ({"page_size": 1}, "--page-size > 1"),
        ({"eagle": True}, "EAGLE"),
        ({"hicache": True}, "--enable-hierarchical-cache"),
        ({"disabled": True}, "--disable-radix-cache"),
        ({"eviction_policy": "slru"}, "--radix-eviction-policy slru"),
    ]:
        reason = refusal(**{**ok, **change})
        assert reason is not None and words in reason and "\n" not in reason
        assert reason.startswith("--radix-cache-backend tpcache")


def test_the_host_tier_setting_is_checked() -> None:
    assert parse_host_pages("") == 0 and parse_host_pages(" 256 ") == 256
    for text in ("-1", "1.5", "lots"):
        with pytest.raises(ValueError, match="TPCACHE_SGLANG_HOST_PAGES must be a whole number") as err:
            parse_host_pages(text)
        assert "\n" not in str(err.value)


def test_the_storage_setting_is_checked(tmp_path: Path) -> None:
    assert parse_storage("", 0) is None and parse_storage(f" {tmp_path} ", 8) == str(tmp_path)
    for text, host, words in [
        ("store", 8, "must be an absolute path of a directory"),
        (str(Path(__file__)), 8, "must be an absolute path of a directory"),
        (str(tmp_path), 0, "set TPCACHE_SGLANG_HOST_PAGES > 0"),
    ]:
        with pytest.raises(ValueError, match="TPCACHE_SGLANG_STORAGE") as err:
            parse_storage(text, host)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_the_test_fault_setting_is_checked() -> None:
    assert parse_faults("") == {}
    assert parse_faults('{"diverge": {"rank": 1, "first_token": 5}}') == {"diverge": {"rank": 1, "first_token": 5}}
    both = '{"diverge": {"rank": 1, "first_token": 5}, "kill": {"rank": 0, "first_token": 6}}'
    assert parse_faults(both) == {"diverge": {"rank": 1, "first_token": 5}, "kill": {"rank": 0, "first_token": 6}}
    bad = ("{", "{}", '{"crash": {}}', '{"diverge": {"rank": 1}}', '{"kill": {"rank": -1, "first_token": 5}}')
    for text in bad:
        with pytest.raises(ValueError, match="TPCACHE_SGLANG_FAULTS") as err:
            parse_faults(text)
        assert "\n" not in str(err.value)


def test_a_host_page_is_one_page_of_sglangs_kv_pool_over_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(engines.SHIMS))  # SGLang's pool module imports what the shims stand in for
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from tpcache.integrations.sglang.radix import engine_kv_of
    from tpcache.io.kv_pool import HostPool

    pool = MHATokenToKVPool(
        size=4 * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=generator))
    kv, layout, _ = engine_kv_of(pool, PAGE)
    host = kv.check_host(HostPool(layout, 2, "page_first"))
    before = [buf.clone() for buf in (*pool.k_buffer, *pool.v_buffer)]
    kv.save(host, [2], [1])  # page 2 (tokens 32..47 of every layer's K and V) -> host slot 1
    kv.load(host, [1], [4])  # -> page 4
    for buf, old in zip((*pool.k_buffer, *pool.v_buffer), before, strict=True):
        assert torch.equal(buf[4 * PAGE : 5 * PAGE], old[2 * PAGE : 3 * PAGE])
        assert torch.equal(buf[: 4 * PAGE], old[: 4 * PAGE])  # nothing else was written
    with pytest.raises(ValueError, match="TPCACHE_SGLANG_HOST_PAGES needs SGLang's MHA KV pool") as err:
        engine_kv_of(object(), PAGE)
    assert "\n" not in str(err.value)
