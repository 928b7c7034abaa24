"""Embedded mode: a TP engine's workers each own one cache rank, no service, no ZMQ.

    torchrun --nproc-per-node 2 examples/embedded_torchrun.py [--requests 60]

Every worker creates a TPCache on its own process group (``make_collective``) and calls the
same operations in the same order, as an engine's TP workers do by construction; once per
scheduler step every worker calls ``step()`` (exactly one all-reduce). Each rank prints its hit
tokens and its state digest; rank 0 checks that every rank ended with the same digest.
"""

from __future__ import annotations

import argparse
import sys
from itertools import islice

import torch.distributed as dist

from tpcache.core import CacheConfig, OutOfPages
from tpcache.dist import make_collective
from tpcache.dist.exchange import all_gather_json
from tpcache.engine import TPCache
from tpcache.workload import SyntheticWorkload, request_tokens


def serve_request(cache: TPCache, tokens: object) -> tuple[int, int]:
    """One engine request: lock the cached prefix, load host hits, compute the rest, insert it."""
    page_size = cache.config.page_size
    lease, match = cache.lock(tokens)  # type: ignore[arg-type]
    device_pages = list(match.device_page_ids)
    if match.host_pages:
        device_pages = cache.load(lease).device_pages  # the engine would wait on .handle per layer
    missing = len(match.page_hashes) - len(device_pages)
    try:
        fresh = cache.alloc(lease, missing) if missing > 0 else []
        # ... the model computes KV for the new tokens into `fresh` here ...
        cache.insert(lease, tokens, device_pages + fresh)  # type: ignore[arg-type]
    except OutOfPages:
        pass  # every device page is pinned: serve this request without caching it
    cache.release(lease)
    cache.drain()  # one or more rounds until this step's copies are agreed complete
    return match.device_pages * page_size, match.host_pages * page_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # NCCL on GPUs; the cache's round picks its own transport
    rank = dist.get_rank()
    config = CacheConfig(page_size=16, device_pages=1024, host_pages=4096, write_policy="write_through")
    cache = TPCache(config, make_collective("auto"), round_timeout_s=30.0)
    device_hits = host_hits = tokens_seen = 0
    try:
        for req in islice(SyntheticWorkload(seed=1, conversations=40).requests(), args.requests):
            tokens = request_tokens(req)
            d, h = serve_request(cache, tokens)
            device_hits, host_hits, tokens_seen = device_hits + d, host_hits + h, tokens_seen + len(tokens)
        stats = cache.stats()
        line = (
            f"rank {rank}: {args.requests} requests, hit tokens device {device_hits} host {host_hits} "
            f"of {tokens_seen}, rounds {stats['rounds']}, digest {stats['digest']}, transport {cache.collective.name}\n"
        )
        sys.stdout.write(line)  # one write: ranks share the terminal, lines must not interleave
        sys.stdout.flush()
        digests = all_gather_json(stats["digest"])
        if rank == 0:
            verdict = "equal" if len(set(digests)) == 1 else "DIFFERENT"
            print(f"digests across {len(digests)} ranks: {verdict}", flush=True)
        ok = len(set(digests)) == 1 and cache.health()["state"] == "open"
    finally:
        cache.close()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
