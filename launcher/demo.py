"""`python -m launcher demo`: the main job in one command.

Starts a local 2-rank service on CPU (metadata only, host tier on), replays the built-in
multi-turn workload (or a Mooncake trace with --trace) through the client, prints a summary and
stops every rank. The workload and cache sizes are chosen so that hits come from both tiers.

Two client modes: one call at a time (the default; each call waits for its round and reply, so
the requests/s line is the round trip of one call, tens per second), or ``--in-flight N``: the
requests go in waves of N, each stage of a wave one burst (``tpcache.service.replay``), so the
line measures what the service sustains with N requests in flight.

The summary says what the pools hold beside what the workload reuses: the hit rate an unbounded
cache would reach on the same requests (every full page seen before is a hit), so a low hit rate
reads as "the pools are small for this trace" rather than as a fault. On a terminal a progress
bar runs on stderr; stdout holds only the summary (one JSON object with --json).

Ctrl-C (SIGINT) or SIGTERM stops the replay and every rank; the demo then exits 130 (SIGINT)
or 0 (SIGTERM) with one line saying how far it got.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import xxhash
from tqdm import tqdm

import protocol as p
from launcher.local import spawn_ranks, stop_ranks, wait_ready
from tpcache.client import Client
from tpcache.replay import ReplayResult
from tpcache.service.config import ConfigError, Resolved
from tpcache.service.replay import replay_pipelined, replay_through_service
from tpcache.workload import SyntheticWorkload, load_trace
from tpcache.workload.trace import Request, TraceError, request_tokens

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


class Interrupted(Exception):
    """The demo stopped early: SIGINT or SIGTERM reached it, or the service said it is stopping.
    ``line()`` says how far it got."""

    def __init__(self, signum: int | None, requests: int = 0, of: int = 0, codes: list[int] | None = None) -> None:
        super().__init__(signal.Signals(signum).name if signum else "the service stopped")
        self.signum, self.requests, self.of, self.codes = signum, requests, of, list(codes or [])

    def line(self) -> str:
        cause = f"stopped by {signal.Signals(self.signum).name}" if self.signum else "the service stopped"
        return (
            f"tpcache demo: {cause} after {self.requests} of {self.of} requests; "
            f"every rank stopped (exit codes {self.codes})"
        )


def demo_requests(trace: str | None, conversations: int, limit: int | None, seed: int) -> list[Any]:
    """The requests to replay; a trace that cannot be read raises ConfigError naming --trace."""
    if not trace:
        return list(islice(SyntheticWorkload(seed=seed, conversations=conversations).requests(), limit))
    try:
        return list(islice(load_trace(trace), limit))
    except FileNotFoundError:
        raise ConfigError(f"--trace {trace}: no such file (a Mooncake-format trace, one JSON object a line)") from None
    except (OSError, UnicodeDecodeError, TraceError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"--trace {trace}: cannot read it as a Mooncake-format trace: {why}") from None


def reuse(requests: Iterable[Request], page_size: int) -> tuple[int, int, int]:
    """(input tokens, tokens an unbounded cache would hit, distinct pages): a full page hits when
    the same page, after the same prefix, was seen in an earlier request."""
    seen: set[int] = set()
    total = hit = 0
    for req in requests:
        tokens = request_tokens(req)
        total += len(tokens)
        prefix = 0
        hitting = True
        for start in range(0, len(tokens) - page_size + 1, page_size):
            prefix = xxhash.xxh3_64_intdigest(tokens[start : start + page_size].tobytes(), seed=prefix)
            if hitting and prefix in seen:
                hit += page_size
            else:
                hitting = False
                seen.add(prefix)
    return total, hit, len(seen)


class _Signals:
    """While installed, the first SIGINT/SIGTERM raises Interrupted in the main thread; later
    ones are ignored, so stopping the ranks is never cut short."""

    def __init__(self) -> None:
        self.old: dict[int, Any] = {}
        self.fired = False

    def __enter__(self) -> _Signals:
        for s in (signal.SIGINT, signal.SIGTERM):
            self.old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.fired:
            self.fired = True
            raise Interrupted(signum)

    def quiet(self) -> None:
        self.fired = True

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)


def run_demo(
    resolved: Resolved,
    nproc: int = 2,
    trace: str | None = None,
    conversations: int = 100,
    limit: int | None = None,
    seed: int = 0,
    in_flight: int = 1,
) -> dict[str, Any]:
    """Run the demo; returns the summary. Raises Interrupted (after stopping every rank),
    ConfigError for a trace it cannot read (before any rank starts), RankExited when the group
    refused to start. ``in_flight`` above 1 replays in pipelined waves of that many requests."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    config = resolved.config
    requests = demo_requests(trace, conversations, limit, seed)
    total, reusable, distinct_pages = reuse(requests, config.page_size)
    result = ReplayResult()
    with tempfile.TemporaryDirectory(prefix="tpcache-demo-") as tmp, _Signals() as signals:
        ready = str(Path(tmp) / "ready.json")
        run = Resolved(config.replace(ready_file=ready), resolved.sources)
        started = time.perf_counter()
        procs: list[Any] = []
        try:
            procs = spawn_ranks(run, nproc)
            info = wait_ready(ready, procs)
            startup_s = time.perf_counter() - started
            with (
                Client(info["endpoint"], token=config.secret or None, timeout_s=config.round_timeout_s + 10) as c,
                tqdm(total=len(requests), unit="req", desc="replay", disable=not sys.stderr.isatty()) as bar,
            ):

                def progress(n: int) -> None:
                    bar.update(n)
                    if result.requests % 16 == 0:
                        bar.set_postfix(hit=f"{result.hit_rate:.1%}", refresh=False)

                if in_flight > 1:
                    _, calls = replay_pipelined(c, requests, in_flight, progress, result=result)
                else:
                    _, calls = replay_through_service(c, requests, progress, result=result)
                stats = c.stats().values
                health = c.health()
        except (Interrupted, p.CacheClosed) as exc:
            signals.quiet()
            signum = exc.signum if isinstance(exc, Interrupted) else None
            raise Interrupted(signum, result.requests, len(requests), stop_ranks(procs)) from None
        except BaseException:
            signals.quiet()
            stop_ranks(procs)
            raise
        signals.quiet()
        codes = stop_ranks(procs)
    cached_tokens = (config.device_pages + config.host_pages) * config.page_size
    return {
        "requests": result.requests,
        "input_tokens": result.input_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": round(result.hit_rate, 4),
        "device_hit_rate": round(result.device_hit_tokens / max(1, result.input_tokens), 4),
        "host_hit_rate": round(result.host_hit_tokens / max(1, result.input_tokens), 4),
        "unbounded_hit_rate": round(reusable / max(1, total), 4),
        "pool_tokens": {"device": config.device_pages * config.page_size, "host": config.host_pages * config.page_size},
        "workload_distinct_tokens": distinct_pages * config.page_size,
        "pools_hold_fraction": round(min(1.0, cached_tokens / max(1, distinct_pages * config.page_size)), 4),
        "refused_pages": result.refused_pages,
        "ranks": nproc,
        "transport": info.get("transport"),
        "rounds": stats.get("rounds"),
        "round_latency_us_p50": stats.get("round_p50_us"),
        "round_latency_us_p99": stats.get("round_p99_us"),
        "in_flight": in_flight,
        "requests_per_s": round(result.requests / result.seconds, 1) if result.seconds else 0.0,
        "calls_per_s": round(calls / result.seconds, 1) if result.seconds else 0.0,
        "call_latency_ms": round(1e3 * result.seconds / calls, 2) if calls else 0.0,
        "replay_seconds": round(result.seconds, 3),
        "startup_seconds": round(startup_s, 2),
        "digests": [stats.get(f"rank{r}.digest") for r in range(nproc)],
        "digests_equal": bool(stats.get("digests_equal")),
        "health": health.state,
        "exit_codes": codes,
    }


def format_summary(s: dict[str, Any]) -> str:
    equal = "yes" if s["digests_equal"] else "NO"
    pools = s["pool_tokens"]
    if s["hit_rate"] < 0.9 * s["unbounded_hit_rate"] and s.get("in_flight", 1) > 1 and s["pools_hold_fraction"] >= 1:
        why = (
            f"the pools hold everything, but requests in one wave of {s['in_flight']} run side by side and do not see"
            " each other's inserts; lower --in-flight to get closer"
        )
    elif s["hit_rate"] < 0.9 * s["unbounded_hit_rate"]:
        why = (
            f"the pools hold {s['pools_hold_fraction']:.1%} of the {s['workload_distinct_tokens']:,} distinct tokens "
            "the workload touches, so reused prefixes are evicted before they come back; "
            "raise --device-pages/--host-pages to get closer"
        )
    else:
        why = "the pools keep nearly everything the workload reuses"
    return "\n".join(
        [
            f"tpcache demo: {s['requests']} requests through a {s['ranks']}-rank service ({s['transport']} rounds)",
            f"  hit rate        {s['hit_rate']:.1%}  (device {s['device_hit_rate']:.1%}, host {s['host_hit_rate']:.1%})"
            f"  of {s['input_tokens']:,} input tokens",
            f"  pools           device {pools['device']:,} tokens, host {pools['host']:,} tokens; an unbounded cache"
            f" would hit {s['unbounded_hit_rate']:.1%}: {why}",
            f"  rounds          {s['rounds']}  latency p50 {s['round_latency_us_p50']} us,"
            f" p99 {s['round_latency_us_p99']} us",
            f"  throughput      {s['requests_per_s']} requests/s, {s['calls_per_s']} calls/s: {_mode(s)}",
            f"  equal digests   {equal}  {s['digests']}",
            f"  health          {s['health']}; ranks exited with {s['exit_codes']}",
        ]
    )


def _mode(s: dict[str, Any]) -> str:
    """What the throughput line measures, in the mode the demo ran."""
    if s.get("in_flight", 1) > 1:
        line = (
            f"pipelined, {s['in_flight']} requests in flight (each stage of a wave sent as one burst): what the service"
            " sustains"
        )
        if s["refused_pages"]:
            line += (
                f"; {s['refused_pages']:,} pages refused for want of space (a wave pins and allocates for all its"
                " requests at once: raise --device-pages or lower --in-flight)"
            )
        return line
    return (
        f"one call at a time, each waiting {s['call_latency_ms']} ms for its round and reply: the round trip, not"
        " what the service sustains (--in-flight 64 --device-pages 65536 pipelines the requests)"
    )


def print_result(summary: dict[str, Any], as_json: bool) -> None:
    print(json.dumps(summary) if as_json else format_summary(summary), flush=True)
