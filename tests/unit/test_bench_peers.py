"""``scripts/bench_core.py --peers`` on a tiny trace: its table's structure, the same hits from every
cache when nothing is evicted, and one line when a peer cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
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
    for name, figure in d["gc"]["engines"].items():
        assert figure["cached_pages"] == 1960, name
        for run_ in ("empty", "built"):  # the workload forces its full collections
            assert figure[run_]["full_collections"] >= 5 and figure[run_]["max_cpu_ms"] > 0


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


def test_a_missing_trace_is_one_line(tmp_path):
    out = run("--trace", str(tmp_path / "absent.jsonl"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"bench_core --peers: the trace {tmp_path / 'absent.jsonl'} does not exist; pass --trace PATH"
    ]
