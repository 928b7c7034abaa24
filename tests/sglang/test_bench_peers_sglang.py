"""``scripts/bench_core.py --peers sglang`` on a tiny trace, in SGLang's venv: SGLang's RadixCache,
driven as the benchmark drives it, hits what every other cache hits when nothing is evicted."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed here: the SGLang ring runs in .venv-sglang (make setup-sglang)",
        allow_module_level=True,
    )

from tests.unit.test_bench_peers import SCRIPT, expected_hit_rate, tiny_trace
from tpcache.testing.child import run_in_own_session


def test_sglang_beside_the_core_on_a_tiny_trace(tmp_path):
    trace = tiny_trace(tmp_path / "t.jsonl")
    argv = [sys.executable, str(SCRIPT), "--peers", "sglang", "--sglang-python", sys.executable]
    argv += ["--trace", str(trace), "--trace-requests", "12", "--repeats", "1", "--cache-tokens", "200000"]
    log = tmp_path / "log"
    code = run_in_own_session([*argv, "--gc-pages", "2000", "--gc-caches", "sglang", "--json"], log, os.environ, 300)
    out = log.read_text()
    assert code == 0, out[-3000:]
    d = json.loads(next(line for line in out.splitlines() if line.startswith('{"peers":')))["peers"]
    assert d["engines"] == ["native", "reference", "dict", "sglang"]
    for ps in (16, 512):
        rows = d["page_sizes"][str(ps)]["engines"]
        assert rows["sglang"]["x_sglang"] == 1.0 and rows["native"]["x_sglang"] > 0
        for row in rows.values():
            assert row["hit_rate"] == round(expected_hit_rate(trace, ps), 4) > 0
    figure = d["gc"]["engines"]["sglang"]
    assert figure["cached_pages"] == 1960 and len(figure["built"]) == figure["rounds"] == 5
    assert all(h["full_collections"] >= 5 for h in figure["built"] + figure["empty"])
