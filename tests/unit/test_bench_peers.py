"""``scripts/bench_core.py --peers`` on a tiny trace: its table's structure, the same hits from every
cache when nothing is evicted, and one line when a peer cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from array import array
from pathlib import Path

from tpcache.testing.child import run_in_own_session
from tpcache.workload.trace import load_trace, request_tokens

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_core.py"


def tiny_trace(path: Path) -> Path:
    """Four conversations of three turns: each turn repeats the one before and adds a block."""
    lines = []
    for turn in range(3):
        for conv in range(4):
            ids = [1000 * conv + j for j in range(turn + 2)]
            lines.append({"timestamp": 0, "input_length": (turn + 2) * 512 - 37 * conv, "hash_ids": ids})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def expected_hit_rate(trace: Path, page: int) -> float:
    """Nothing evicted: a request hits the longest run of full pages an earlier request held, at
    most its length minus one token."""
    seen: set[bytes] = set()
    hit = total = 0
    for req in load_trace(trace):
        data = request_tokens(req).tobytes()
        n = len(data) // 4
        k = 0
        while (k + 1) * page <= n - 1 and data[: (k + 1) * page * 4] in seen:
            k += 1
        hit += k * page
        total += n
        seen.update(data[: j * page * 4] for j in range(1, n // page + 1))
    return hit / total


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--peers", *args], capture_output=True, text=True, timeout=60)


def test_peers_table_on_a_tiny_trace(tmp_path):
    trace = tiny_trace(tmp_path / "t.jsonl")
    argv = [sys.executable, str(SCRIPT), "--peers", "vllm", "--trace", str(trace), "--trace-requests", "12"]
    argv += ["--repeats", "2", "--cache-tokens", "200000", "--gc-pages", "2000", "--gc-caches", "native", "dict"]
    argv += ["--gc-rounds", "3"]
    log = tmp_path / "log"
    code = run_in_own_session([*argv, "--json"], log, os.environ, 300)  # its workers go with it
    out = log.read_text()
    assert code == 0, out[-3000:]
    d = json.loads(next(line for line in out.splitlines() if line.startswith('{"peers":')))["peers"]
    assert d["engines"] == ["native", "reference", "dict", "vllm"]
    for ps in (16, 512):
        table = d["page_sizes"][str(ps)]
        assert table["cache_pages"] == 200_000 // ps
        rows = table["engines"]
        assert set(rows) == set(d["engines"])
        for row in rows.values():
            assert 0 < row["spread"][0] <= row["us_per_page"] <= row["spread"][1]
            assert row["same_hits_every_pass"] and "x_dict" in row and "x_sglang" not in row
            # Nothing is evicted, so every cache hits alike, as the independent count says.
            assert row["hit_rate"] == round(expected_hit_rate(trace, ps), 4) > 0
        assert rows["dict"]["x_dict"] == 1.0
    assert f"16-token pages: {200_000 // 16:,}-page caches" in out
    assert set(d["gc"]["engines"]) == {"native", "dict"}
    assert d["gc"]["rounds"] == 3 and "medians of 3 interleaved rounds" in out
    for name, figure in d["gc"]["engines"].items():
        assert figure["cached_pages"] == 1960, name
        for side in ("empty", "built"):  # each half of each round forces its full collections
            assert len(figure[side]) == 3, name
            assert all(h["full_collections"] >= 5 and h["max_cpu_ms"] > 0 for h in figure[side]), name
        for clock in ("cpu", "wall"):  # the median of the rounds' differences, inside their spread
            lo, hi = figure[f"spread_{clock}_ms"]
            pairs = zip(figure["empty"], figure["built"], strict=True)
            diffs = sorted(b[f"max_{clock}_ms"] - e[f"max_{clock}_ms"] for e, b in pairs)
            assert [lo, figure[f"figure_{clock}_ms"], hi] == [diffs[0], diffs[1], diffs[2]], name


def test_gc_tokens_are_the_benchmark_sequences(monkeypatch):
    """The GC figure's requests, sliced from a ring, are ``bench_core.sequence``'s token ids."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_core
    import core_peers

    tokens = list(core_peers.context_tokens(1700))
    assert len(tokens) == 1700
    for i in (0, 1, 1541, 1612, 1613, 1699):  # 1541 to 1612 run past the ring's end
        assert tokens[i] == array("i", bench_core.sequence(i, bench_core.CONTEXT_PAGES)), i


def test_a_missing_peer_is_named_in_one_line(tmp_path):
    trace = tiny_trace(tmp_path / "t.jsonl")
    absent = run("sglang", "--trace", str(trace), "--sglang-python", str(tmp_path / "none" / "python"))
    assert absent.returncode == 2 and absent.stdout == ""
    assert absent.stderr.strip().splitlines() == [
        f"bench_core --peers: sglang: no interpreter at {tmp_path / 'none' / 'python'} (make setup-sglang)"
    ]
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a real interpreter without vLLM
    python = bare / "bin" / "python"
    missing = run("vllm", "--trace", str(trace), "--vllm-python", str(python))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [f"bench_core --peers: vllm: vllm is not installed for {python}"]


def test_gc_rounds_below_one_is_one_line(tmp_path):
    out = run("vllm", "--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--gc-rounds", "0")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["bench_core --peers: --gc-rounds is 0; it must be at least 1"]


def test_a_missing_trace_is_one_line(tmp_path):
    out = run("--trace", str(tmp_path / "absent.jsonl"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"bench_core --peers: the trace {tmp_path / 'absent.jsonl'} does not exist; pass --trace PATH"
    ]
