#!/usr/bin/env python3
"""Replay a Mooncake-format trace (or the built-in workload) through the cache core.

    python scripts/replay.py --trace ../shared/data/mooncake/conversation_trace.jsonl \
        --device-tokens 3000000 --page-size 512 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.core.eviction import POLICIES  # noqa: E402
from tpcache.replay import config_for_tokens, replay  # noqa: E402
from tpcache.workload import SyntheticWorkload, load_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="Mooncake-format JSONL trace; omit for the built-in workload")
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--device-tokens", type=int, help="device tier capacity in tokens (omit: unbounded)")
    ap.add_argument("--host-tokens", type=int, default=0, help="host tier capacity in tokens (0: no host tier)")
    ap.add_argument("--page-size", type=int, default=512, help="tokens per page (default 512, the trace's block)")
    ap.add_argument("--policy", default="lru", choices=sorted(POLICIES), help="eviction policy")
    ap.add_argument("--seed", type=int, default=0, help="seed of the built-in workload")
    ap.add_argument("--conversations", type=int, default=400, help="conversations in the built-in workload")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    if args.trace:
        requests = list(load_trace(args.trace, args.limit))
    else:
        requests = list(SyntheticWorkload(seed=args.seed, conversations=args.conversations).requests())
        if args.limit:
            requests = requests[: args.limit]
    host_pages = args.host_tokens // args.page_size
    config = config_for_tokens(
        args.device_tokens,
        args.page_size,
        host_pages=host_pages,
        eviction_policy=args.policy,
        write_policy="write_through" if host_pages else "none",
    )
    bar = None
    if sys.stderr.isatty() and not args.json:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", file=sys.stderr)
    result, _ = replay(requests, config, progress=bar.update if bar else None)
    if bar:
        bar.close()
    out = result.to_dict()
    out.update(
        source=args.trace or f"synthetic(seed={args.seed})",
        device_tokens=args.device_tokens,
        page_size=args.page_size,
        policy=args.policy,
    )
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        width = max(len(k) for k in out)
        for key, value in out.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
