"""`python -m launcher demo`: the main job in one command.

Starts a local 2-rank service on CPU (metadata only, host tier on), replays the built-in
multi-turn workload (or a Mooncake trace with --trace) through the client, prints a summary and
stops every rank. The workload and cache sizes are chosen so that hits come from both tiers.
"""

from __future__ import annotations

import json
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

from launcher.local import spawn_ranks, stop_ranks, wait_ready
from tpcache.client import Client
from tpcache.service.config import ServiceConfig
from tpcache.service.replay import replay_through_service
from tpcache.workload import SyntheticWorkload, load_trace

# Demo defaults (below the environment and --config): a device tier of 32k tokens, a host tier of
# 128k: the workload's conversations outgrow the device tier, so later turns hit on host too.
DEMO_DEFAULTS: dict[str, Any] = {
    "endpoint": "tcp://127.0.0.1:0",
    "page_size": 16,
    "device_pages": 2048,
    "host_pages": 8192,
    "write_policy": "write_through",
    "round_timeout_s": 20.0,
}


def demo_requests(trace: str | None, conversations: int, limit: int | None, seed: int) -> list[Any]:
    source = load_trace(trace) if trace else SyntheticWorkload(seed=seed, conversations=conversations).requests()
    return list(islice(source, limit))


def run_demo(
    config: ServiceConfig,
    nproc: int = 2,
    trace: str | None = None,
    conversations: int = 100,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    requests = demo_requests(trace, conversations, limit, seed)
    with tempfile.TemporaryDirectory(prefix="tpcache-demo-") as tmp:
        ready = str(Path(tmp) / "ready.json")
        config = config.replace(ready_file=ready)
        started = time.perf_counter()
        procs = spawn_ranks(config, nproc)
        try:
            info = wait_ready(ready, procs)
            startup_s = time.perf_counter() - started
            with Client(info["endpoint"], token=config.secret or None, timeout_s=config.round_timeout_s + 10) as client:
                result, calls = replay_through_service(client, requests)
                stats = client.stats().values
                health = client.health()
        finally:
            codes = stop_ranks(procs)
    return {
        "requests": result.requests,
        "input_tokens": result.input_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": round(result.hit_rate, 4),
        "device_hit_rate": round(result.device_hit_tokens / max(1, result.input_tokens), 4),
        "host_hit_rate": round(result.host_hit_tokens / max(1, result.input_tokens), 4),
        "refused_pages": result.refused_pages,
        "ranks": nproc,
        "transport": info.get("transport"),
        "rounds": stats.get("rounds"),
        "round_latency_us_p50": stats.get("round_p50_us"),
        "round_latency_us_p99": stats.get("round_p99_us"),
        "requests_per_s": round(result.requests / result.seconds, 1) if result.seconds else 0.0,
        "calls_per_s": round(calls / result.seconds, 1) if result.seconds else 0.0,
        "replay_seconds": round(result.seconds, 3),
        "startup_seconds": round(startup_s, 2),
        "digests": [stats.get(f"rank{r}.digest") for r in range(nproc)],
        "digests_equal": bool(stats.get("digests_equal")),
        "health": health.state,
        "exit_codes": codes,
    }


def format_summary(s: dict[str, Any]) -> str:
    equal = "yes" if s["digests_equal"] else "NO"
    return "\n".join(
        [
            f"tpcache demo: {s['requests']} requests through a {s['ranks']}-rank service ({s['transport']} rounds)",
            f"  hit rate        {s['hit_rate']:.1%}  (device {s['device_hit_rate']:.1%}, host {s['host_hit_rate']:.1%})"
            f"  of {s['input_tokens']:,} input tokens",
            f"  rounds          {s['rounds']}  latency p50 {s['round_latency_us_p50']} us,"
            f" p99 {s['round_latency_us_p99']} us",
            f"  throughput      {s['requests_per_s']} requests/s ({s['calls_per_s']} calls/s, one call per round trip)",
            f"  equal digests   {equal}  {s['digests']}",
            f"  health          {s['health']}; ranks exited with {s['exit_codes']}",
        ]
    )


def print_result(summary: dict[str, Any], as_json: bool) -> None:
    print(json.dumps(summary) if as_json else format_summary(summary), flush=True)
