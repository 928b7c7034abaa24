"""What the vLLM connector's ranks agree on before the cache is built, without vLLM: the host tier
from the least free memory any rank reads, and explicit settings that must be equal."""

from __future__ import annotations

import logging

import pytest

from tpcache.integrations.vllm.options import (
    DEFAULT_HOST_CAP_BYTES,
    ConnectorOptions,
    agree_host_tier,
    rank_facts,
)
from tpcache.service.config import ConfigError

PAGE_BYTES = 1 << 16
LAYOUT = "L2xH2xD32:bf16 vllm[B,2,32,64]order=0123torch.bfloat16"
GIB = 1 << 30


def facts(available: int | None, layout: str = LAYOUT, **extra: object) -> dict:
    out = rank_facts(ConnectorOptions.from_extra_config(extra), layout)
    out["available"] = available  # this rank's reading of its free memory
    return out


def test_ranks_that_read_different_free_memory_agree_on_the_least() -> None:
    options = ConnectorOptions.from_extra_config({})
    gathered = [facts(20 * GIB), facts(19 * GIB), facts(21 * GIB)]
    host = agree_host_tier(options, gathered, PAGE_BYTES)
    assert host.source == "free memory" and host.agreed_available == 19 * GIB
    assert host.pages == int(19 * GIB * 0.1) // 3 // PAGE_BYTES
    # the same answer whichever rank computes it, and whatever order the readings came in
    assert agree_host_tier(options, list(reversed(gathered)), PAGE_BYTES).pages == host.pages
    line = host.describe()
    assert f"host tier {host.pages} pages of 64 KiB" in line
    assert "least memory available on any rank, 19 GiB, shared by 3 ranks" in line
    assert "available: rank 0 20 GiB, rank 1 19 GiB, rank 2 21 GiB" in line


def test_the_agreed_host_tier_is_capped_and_survives_an_unknown_reading() -> None:
    options = ConnectorOptions.from_extra_config({})
    big = agree_host_tier(options, [facts(1 << 44), facts(1 << 44)], PAGE_BYTES)
    assert big.pages == DEFAULT_HOST_CAP_BYTES // PAGE_BYTES
    one_unknown = agree_host_tier(options, [facts(None), facts(10 * GIB)], PAGE_BYTES)
    assert one_unknown.agreed_available == 10 * GIB
    assert "rank 0 unknown, rank 1 10 GiB" in one_unknown.describe()


def test_explicit_sizes_win_over_free_memory() -> None:
    gathered = [facts(20 * GIB, host_pages=512), facts(3 * GIB, host_pages=512)]
    host = agree_host_tier(ConnectorOptions.from_extra_config({"host_pages": 512}), gathered, PAGE_BYTES)
    assert (host.pages, host.source) == (512, "host_pages")
    assert host.describe() == "host tier 512 pages of 64 KiB (32 MiB, from host_pages)"
    by_bytes = [facts(1, host_bytes=10 * PAGE_BYTES), facts(2, host_bytes=10 * PAGE_BYTES)]
    options = ConnectorOptions.from_extra_config({"host_bytes": 10 * PAGE_BYTES})
    assert agree_host_tier(options, by_bytes, PAGE_BYTES).pages == 10


def test_explicit_settings_that_differ_stop_the_group_in_one_line() -> None:
    gathered = [
        facts(GIB, host_pages=512, storage_bytes=1 << 30),
        facts(GIB, host_pages=256, storage_bytes=1 << 30, storage_dir="/elsewhere", metrics_port=9000),
    ]
    with pytest.raises(ConfigError) as err:
        agree_host_tier(ConnectorOptions.from_extra_config({"host_pages": 512}), gathered, PAGE_BYTES)
    assert str(err.value) == (
        "kv_connector_extra_config: settings that must be equal on every TP rank differ: "
        "host_pages (rank 0 512, rank 1 256); storage (rank 0 false, rank 1 true)"
    )


def test_ranks_with_different_kv_page_layouts_stop_before_the_cache_is_built() -> None:
    gathered = [facts(GIB), facts(GIB, layout="L2xH1xD32:bf16 vllm[B,1,32,64]order=0123torch.bfloat16")]
    with pytest.raises(ConfigError, match=r"KV page layout differs across TP ranks \(rank 0 L2xH2xD32.*, rank 1 L2xH1"):
        agree_host_tier(ConnectorOptions.from_extra_config({}), gathered, PAGE_BYTES)


def test_tpcache_logs_print_through_the_vllm_handler() -> None:
    """Under vLLM only the ``vllm`` logger has a handler: tpcache's lines (a close's cause from
    ``tpcache.round``, the connector's own under ``vllm.tpcache``) must reach it, once each."""

    from tpcache.integrations.vllm.logs import LOGGER, speak_through_vllm

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(f"{record.levelname} {record.getMessage()}")

    vllm, ours = logging.getLogger("vllm"), logging.getLogger("tpcache")
    saved = (vllm.handlers[:], vllm.level, vllm.propagate, ours.handlers[:], ours.level, ours.propagate)
    keep = Keep()
    try:
        vllm.handlers, vllm.propagate = [keep], False  # as vLLM's logging config leaves it
        vllm.setLevel(logging.INFO)
        ours.handlers, ours.level = [], logging.NOTSET
        speak_through_vllm()
        speak_through_vllm()  # a second connector in the process adds nothing
        logging.getLogger("tpcache.round").error("round 3: cache closed: layout differs across ranks")
        logging.getLogger(LOGGER).info("tpcache 0.1.0 rank 0 of 2: host tier 512 pages")
        logging.getLogger("tpcache.shell").debug("not at vLLM's level")
        assert keep.lines == [
            "ERROR round 3: cache closed: layout differs across ranks",
            "INFO tpcache 0.1.0 rank 0 of 2: host tier 512 pages",
        ]
    finally:
        vllm.handlers, vllm.level, vllm.propagate, ours.handlers, ours.level, ours.propagate = saved


def test_a_worker_whose_cache_closes_warns_with_the_cause_once(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 applies a lookup the other rank never got: the round closes the cache on both, and
    each worker says so at WARNING with the round's reason; the close that recurs says no more."""
    from typing import Any

    from tests.engine.test_external_pages import engine_kv, make, run_ranks, toks
    from tpcache.integrations.vllm.messages import LOOKUP, StepOps
    from tpcache.integrations.vllm.worker import WorkerSide

    def body(rank: int, collective: Any) -> tuple[list[bool], int]:
        side = WorkerSide(make(engine_kv(rank), collective), reopen=False)
        closed = []
        for step in range(3):
            ops = [(LOOKUP, "extra", toks(1, 2))] if rank == 1 and step == 0 else []
            closed.append(side.run_step(StepOps(step=step, ops=ops)).report.closed)
        return closed, side.totals()["closes"]  # vLLM's stats count the close once

    caplog.set_level(logging.WARNING, logger="vllm.tpcache")
    assert run_ranks(body) == [([True, True, True], 1), ([True, True, True], 1)]
    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "vllm.tpcache")
    assert len(warnings) == 2, warnings
    for rank, line in enumerate(warnings):
        assert line.startswith(f"tpcache rank {rank}: the cache closed (seq differs across ranks"), line
        assert line.endswith("it serves no hits from now on (reopen is off); vLLM computes those prefixes"), line


KEY = "a deployment secret of 32 bytes!"


def test_storage_keys_that_differ_stop_the_group_in_one_line_that_shows_no_key() -> None:
    options = ConnectorOptions.from_extra_config({"storage_dir": "/tmp/x"})
    other = "another secret, also long enough"
    gathered = [rank_facts(options, LAYOUT, KEY), rank_facts(options, LAYOUT, other), rank_facts(options, LAYOUT, "")]
    with pytest.raises(ConfigError) as err:
        agree_host_tier(options, gathered, PAGE_BYTES)
    assert str(err.value) == (
        "TPCACHE_STORAGE_KEY: the storage key must be the same on every TP rank; it differs "
        "(rank 0 key A, rank 1 key B, rank 2 unset)"
    )
    shown = str(err.value) + repr(gathered)
    assert KEY not in shown and other not in shown  # the facts exchanged carry a fingerprint only


def test_a_storage_key_too_short_on_one_rank_stops_every_rank_before_the_cache_is_built() -> None:
    options = ConnectorOptions.from_extra_config({"storage_dir": "/tmp/x"})
    gathered = [rank_facts(options, LAYOUT, KEY), rank_facts(options, LAYOUT, "short key")]
    with pytest.raises(ConfigError) as err:
        agree_host_tier(options, gathered, PAGE_BYTES)
    assert str(err.value) == (
        "TPCACHE_STORAGE_KEY: the storage key must be at least 16 bytes (a deployment secret), "
        "the same on every TP rank; shorter on rank 1"
    )
    assert "short key" not in str(err.value)


def test_the_same_storage_key_on_every_rank_or_none_agrees() -> None:
    options = ConnectorOptions.from_extra_config({"storage_dir": "/tmp/x", "host_pages": 8})
    assert agree_host_tier(options, [rank_facts(options, LAYOUT, KEY)] * 2, PAGE_BYTES).pages == 8
    assert agree_host_tier(options, [rank_facts(options, LAYOUT, "")] * 2, PAGE_BYTES).pages == 8
    off = ConnectorOptions.from_extra_config({"host_pages": 8})  # storage off: the key is not used
    gathered = [rank_facts(off, LAYOUT, KEY), rank_facts(off, LAYOUT, "short")]
    assert agree_host_tier(off, gathered, PAGE_BYTES).pages == 8


def test_a_rank_reads_its_storage_key_from_the_environment_as_the_connector_does(monkeypatch) -> None:
    options = ConnectorOptions.from_extra_config({"storage_dir": "/tmp/x"})
    monkeypatch.setenv("TPCACHE_STORAGE_KEY", "short")
    gathered = [rank_facts(options, LAYOUT, KEY), rank_facts(options, LAYOUT)]
    with pytest.raises(ConfigError, match="at least 16 bytes .* shorter on rank 1$"):
        agree_host_tier(options, gathered, PAGE_BYTES)
    monkeypatch.setenv("TPCACHE_STORAGE_KEY", KEY)
    assert rank_facts(options, LAYOUT)["storage_key"] == rank_facts(options, LAYOUT, KEY)["storage_key"] != ""


def test_the_tree_core_option_is_checked_against_the_core_the_workers_run() -> None:
    from tpcache.core import backend

    assert ConnectorOptions.from_extra_config({"tree_core": backend.NAME}).tree_core == backend.NAME
    other = "reference" if backend.NAME == "native" else "native"
    with pytest.raises(ConfigError) as refused:
        ConnectorOptions.from_extra_config({"tree_core": other})
    assert str(refused.value).startswith(f"kv_connector_extra_config: tree_core = {other}: ")
    assert "TPCACHE_TREE_CORE" in str(refused.value) or "not built" in str(refused.value)
    with pytest.raises(ConfigError, match="tree_core = fast: must be one of native, reference"):
        ConnectorOptions.from_extra_config({"tree_core": "fast"})
