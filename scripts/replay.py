#!/usr/bin/env python3
"""Replay a Mooncake-format trace (or the built-in workload) through the cache core.

    python scripts/replay.py --trace ../shared/data/mooncake/conversation_trace.jsonl \
        --device-tokens 3000000 --page-size 512 --json
    python scripts/replay.py --trace ... --device-tokens 3000000 --swa-window 4096 --mamba-every 4 --json

With --swa-window and/or --mamba-every the model is hybrid: the hit rule needs the SWA pages of the
window before a hit's boundary and a state at it, requests prefill in chunks, and the result adds
the pages (states) each component holds, at the end and averaged over the requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.core import CacheConfig  # noqa: E402
from tpcache.core.treecore.eviction import POLICIES  # noqa: E402
from tpcache.replay import config_for_tokens, replay  # noqa: E402
from tpcache.workload import SyntheticWorkload, load_trace  # noqa: E402


def hybrid_config(config: CacheConfig, args: argparse.Namespace) -> CacheConfig:
    """The configuration with the components the options ask for (pools as large as the full ones
    unless given; the host pools as the full host pool)."""
    fields = config.to_dict()
    if args.swa_window:
        swa_pages = config.device_pages if args.swa_tokens is None else args.swa_tokens // args.page_size
        fields.update(swa_window=args.swa_window, swa_device_pages=swa_pages, swa_host_pages=config.host_pages)
        fields.update(swa_release_out_of_window=not args.keep_swa)
    if args.mamba_every:
        states = config.device_pages if args.mamba_states is None else args.mamba_states
        fields.update(mamba_every=args.mamba_every, mamba_device_states=states, mamba_host_states=config.host_pages)
    return CacheConfig(**fields)  # type: ignore[arg-type]


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
    ap.add_argument("--swa-window", type=int, default=0, help="sliding-window component: window in tokens")
    ap.add_argument("--swa-tokens", type=int, help="SWA device pool in tokens (default: as --device-tokens)")
    ap.add_argument(
        "--mamba-every", type=int, default=0, help="Mamba component: a state every N pages (-1: at each insert's end)"
    )
    ap.add_argument("--mamba-states", type=int, help="Mamba device pool in states (default: the full pages)")
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="hybrid: prefill chunk size in tokens")
    ap.add_argument(
        "--keep-swa", action="store_true", help="hybrid: keep SWA behind each request's window (no release)"
    )
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
    if args.swa_window or args.mamba_every:
        config = hybrid_config(config, args)
    bar = None
    if sys.stderr.isatty() and not args.json:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", file=sys.stderr)
    result, _ = replay(requests, config, progress=bar.update if bar else None, chunk_tokens=args.chunk_tokens)
    if bar:
        bar.close()
    out = result.to_dict()
    out.update(
        source=args.trace or f"synthetic(seed={args.seed})",
        device_tokens=args.device_tokens,
        page_size=args.page_size,
        policy=args.policy,
    )
    if config.components():
        out.update(swa_window=args.swa_window, mamba_every=args.mamba_every, chunk_tokens=args.chunk_tokens)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        width = max(len(k) for k in out)
        for key, value in out.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
