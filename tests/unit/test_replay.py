import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tpcache.replay import config_for_tokens, replay
from tpcache.workload import SyntheticWorkload, load_trace, request_tokens
from tpcache.workload.trace import Request, TraceError

# Computed by an independent simulator (device tier only, LRU, page size 512) on the Mooncake
# conversation trace; see ../shared/data/mooncake/README.md.
REFERENCE = [(1_000_000, 0.0559), (3_000_000, 0.1437), (10_000_000, 0.2976), (None, 0.3734)]


@pytest.mark.slow
@pytest.mark.parametrize("device_tokens,expected", REFERENCE)
def test_mooncake_hit_rate_matches_independent_simulator(trace_path, device_tokens, expected):
    requests = list(load_trace(trace_path))
    assert sum(len(r.hash_ids) for r in requests) == 288_500
    result, core = replay(requests, config_for_tokens(device_tokens, 512, write_policy="none"))
    assert result.requests == 12031
    assert result.pages == sum(r.input_length // 512 for r in requests)  # partial blocks never cached
    assert abs(result.hit_rate - expected) <= 0.002, result.to_dict()
    if device_tokens is not None:
        assert core.device.used * 512 <= device_tokens


def test_replay_is_deterministic_and_hits_grow_with_capacity():
    reqs = list(SyntheticWorkload(seed=3, conversations=60).requests())
    small, _ = replay(reqs, config_for_tokens(16 * 512, 512, write_policy="none"))
    again, _ = replay(reqs, config_for_tokens(16 * 512, 512, write_policy="none"))
    big, _ = replay(reqs, config_for_tokens(None, 512, write_policy="none"))
    assert (small.hit_tokens, small.digest) == (again.hit_tokens, again.digest)
    assert 0 < small.hit_tokens < big.hit_tokens < big.input_tokens


def test_host_tier_turns_device_misses_into_host_hits():
    reqs = list(SyntheticWorkload(seed=5, conversations=80).requests())
    dev_only, _ = replay(reqs, config_for_tokens(32 * 512, 512, write_policy="none"))
    cfg = config_for_tokens(32 * 512, 512, host_pages=256, write_policy="write_through")
    tiered, core = replay(reqs, cfg)
    assert tiered.host_hit_tokens > 0
    assert tiered.hit_tokens > dev_only.hit_tokens


def test_synthetic_workload_shares_prefixes_and_is_seeded():
    a = list(SyntheticWorkload(seed=1, conversations=20).requests())
    b = list(SyntheticWorkload(seed=1, conversations=20).requests())
    c = list(SyntheticWorkload(seed=2, conversations=20).requests())
    assert a == b and a != c
    firsts = {r.hash_ids[0] for r in a}
    assert len(firsts) < len(a)  # system prompts are shared
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // 512)


def test_trace_tokens_follow_hash_ids():
    r1 = Request(input_length=1024, hash_ids=(5, 6))
    r2 = Request(input_length=700, hash_ids=(5, 9))
    t1, t2 = request_tokens(r1), request_tokens(r2)
    assert len(t2) == 700
    assert t1[:512] == t2[:512] and t1[512:700] != t2[512:700]


def test_bad_trace_lines_are_reported_with_their_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"input_length": 600, "hash_ids": [1, 2]}\n{"input_length": 2000, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=":2:"):
        list(load_trace(p))


def test_replay_script_prints_json():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "replay.py"),
            "--conversations",
            "30",
            "--device-tokens",
            "8192",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    d = json.loads(out.stdout)
    for key in ("requests", "input_tokens", "hit_tokens", "hit_rate", "pages_per_s", "pages_per_cpu_s"):
        assert key in d
    assert d["hit_rate"] == pytest.approx(d["hit_tokens"] / d["input_tokens"], abs=1e-6)


@pytest.mark.parametrize("source", ["synthetic", "trace"])
def test_write_back_replay_under_pressure_refuses_cleanly(source, request):
    """Write-back with small pools: allocs and loads that cannot be met are refused (the request
    computes instead), never a crash after a passed check, and the core stays consistent."""
    from tpcache.core import CacheConfig, check

    if source == "trace":
        reqs = list(load_trace(request.getfixturevalue("trace_path"), limit=400))
    else:
        reqs = list(SyntheticWorkload(seed=9, conversations=80).requests())
    config = CacheConfig(page_size=512, device_pages=400, host_pages=1600, write_policy="write_back")
    result, core = replay(reqs, config)
    check(core)
    assert result.requests == len(reqs) and result.host_hit_tokens > 0
