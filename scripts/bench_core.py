#!/usr/bin/env python3
"""What the core costs per scheduler step, against a dict prefix cache written here (the floor).

    python scripts/bench_core.py --json
    python scripts/bench_core.py --sizes 10000 100000 --repeats 3
    python scripts/bench_core.py --peers --trace ../shared/data/mooncake/conversation_trace.jsonl

``--peers [vllm] [sglang]`` measures instead the core beside vLLM's KVCacheManager and SGLang's
RadixCache on one request stream (both when no name is given; scripts/core_peers.py says how).

The floor is the prefix cache an engine writes for itself (vLLM v1 style): a page is keyed by the
hash of its parent's key and its tokens, a dict maps keys to page ids, pages carry a reference
count, and unreferenced cached pages sit in an LRU (an OrderedDict) that allocation evicts from.
It has no tiers, no agreement and no digest: it is what the core must come close to.

Measured, in thread CPU time (steadier than wall time on a shared machine), medians of
``--repeats`` runs with their spread:

- ``cases``: per page, a hit cycle (lock a cached prefix, insert it back, release) and a miss
  cycle (lock an unseen prefix, alloc, insert, release, evicting as the pool is full), with the
  cache holding 10k, 100k and 1M pages;
- ``insert``: 2 new pages after a 14-page and after a 140-page context, given to ``append`` alone
  (``append_*``: the cost follows the pages added, not the path) and to ``insert`` with the whole
  sequence (``context_*``: it walks the path);
- ``step``: an engine step with 625k cached pages and 256 running requests of ~140 pages, each
  doing alloc(2) + append of its 2 new pages, then one round on one rank (``Round.prepare`` and
  ``commit`` with every copy landed: its completions, the state digest it agrees on, what a commit
  does after them; the floor hashes and inserts the same 2 pages); ``sparse_ms``: the same step when
  only 16 requests complete a page;
  ``whole_insert_ms``: the step with match + alloc(2) + insert of the whole sequence instead; each
  the median of ``--steps`` steps in a row, the core's and the floor's alternating;
- ``bytes_per_page`` (RSS growth over the cached pages, page size 16) and ``max_gc_pause_ms``
  (the longest collection while the largest cache was built, from ``gc.callbacks``, wall time;
  ``max_gc_pause_cpu_ms``: the same in this thread's CPU time, which preemption does not stretch).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tpcache.core import CacheConfig, CacheCore  # noqa: E402
from tpcache.core.round import Round  # noqa: E402
from tpcache.replay import drain  # noqa: E402

PAGE = 16
CONTEXT_PAGES = 140
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(os.path.dirname(REPO), "shared", "data", "mooncake", "conversation_trace.jsonl")
SGLANG_PYTHON = os.path.join(REPO, ".venv-sglang", "bin", "python")


class DictPrefixCache:
    """The floor: hash-keyed pages, reference counts, LRU over unreferenced pages."""

    def __init__(self, pages: int) -> None:
        self.free = list(range(pages))
        self.by_key: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.refs = [0] * pages
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody references

    @staticmethod
    def keys(tokens: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(0, len(tokens) - PAGE + 1, PAGE):
            parent = hash((parent, tuple(tokens[i : i + PAGE])))
            out.append(parent)
        return out

    def match(self, keys: list[int]) -> list[int]:
        hit = []
        for k in keys:
            page = self.by_key.get(k)
            if page is None:
                break
            hit.append(page)
        for page in hit:
            if self.refs[page] == 0:
                self.lru.pop(page, None)
            self.refs[page] += 1
        return hit

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.by_key[self.key_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def insert(self, keys: list[int], pages: list[int]) -> None:
        for k, page in zip(keys, pages, strict=False):
            if k not in self.by_key and page not in self.key_of:
                self.by_key[k] = page
                self.key_of[page] = k

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.lru[page] = None
                else:
                    self.free.append(page)


def sequence(i: int, pages: int) -> list[int]:
    """Token ids of request ``i``: its first token is ``i``, so it shares no page with another."""
    return [i] + [(i * 31 + t) % 50_000 for t in range(1, pages * PAGE)]


def thread_cpu(fn: Callable[..., Any], cache: Any, work: list[list[int]]) -> float:
    """Thread CPU seconds of ``fn(cache, tokens)`` over every request of ``work``."""
    start = time.thread_time()
    for tokens in work:
        fn(cache, tokens)
    return time.thread_time() - start


# ---------------------------------------------------------------------- the two caches' cycles


def fill_core(pages: int) -> tuple[CacheCore, int]:
    """A core holding ``pages // CONTEXT_PAGES`` requests of CONTEXT_PAGES pages (request ids 0..n-1;
    their tokens are made again from the id, so the benchmark's own memory stays out of the RSS)."""
    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=pages))
    n = pages // CONTEXT_PAGES
    for i in range(n):
        core_miss(core, sequence(i, CONTEXT_PAGES))
    return core, n


def fill_dict(pages: int) -> tuple[DictPrefixCache, int]:
    cache = DictPrefixCache(pages)
    n = pages // CONTEXT_PAGES
    for i in range(n):
        dict_miss(cache, sequence(i, CONTEXT_PAGES))
    return cache, n


def core_hit(core: CacheCore, tokens: list[int]) -> None:
    lease, match = core.lock(tokens)
    core.insert(lease, tokens, list(match.device_page_ids))
    core.release(lease)
    drain(core)


def core_miss(core: CacheCore, tokens: list[int]) -> None:
    lease, match = core.lock(tokens)
    have = list(match.device_page_ids)
    fresh = core.alloc(lease, len(tokens) // PAGE - len(have))
    core.insert(lease, tokens, have + fresh)
    core.release(lease)
    drain(core)


def dict_hit(cache: DictPrefixCache, tokens: list[int]) -> None:
    keys = cache.keys(tokens)
    pages = cache.match(keys)
    cache.insert(keys, pages)
    cache.release(pages)


def dict_miss(cache: DictPrefixCache, tokens: list[int]) -> None:
    keys = cache.keys(tokens)
    pages = cache.match(keys)
    pages += cache.alloc(len(keys) - len(pages))
    cache.insert(keys, pages)
    cache.release(pages)


def cycle_cases(sizes: list[int], repeats: int, requests: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    memory: dict[str, Any] = {}
    for pages in sizes:
        pauses: list[float] = []
        cpu_pauses: list[float] = []
        gc.collect()
        rss0 = rss_bytes()
        with gc_pauses(pauses, cpu_pauses):
            core, n_seqs = fill_core(pages)
        gc.collect()
        if pages == max(sizes):
            cached = n_seqs * CONTEXT_PAGES
            memory = {
                "pages": pages,
                "bytes_per_page": round((rss_bytes() - rss0) / max(cached, 1), 1),
                "max_gc_pause_ms": round(max(pauses, default=0.0) * 1e3, 2),
                "max_gc_pause_cpu_ms": round(max(cpu_pauses, default=0.0) * 1e3, 2),
            }
        cache, _ = fill_dict(pages)
        for cycle in ("hit", "miss"):
            ours, floor = [], []
            for r in range(repeats):
                picks = [sequence((r * requests + j * 7919) % n_seqs, CONTEXT_PAGES) for j in range(requests)]
                fresh = [sequence(10_000_000 + pages + r * requests + j, CONTEXT_PAGES) for j in range(requests)]
                n = requests * CONTEXT_PAGES
                if cycle == "hit":
                    ours.append(thread_cpu(core_hit, core, picks) / n)
                    floor.append(thread_cpu(dict_hit, cache, picks) / n)
                else:
                    ours.append(thread_cpu(core_miss, core, fresh) / n)
                    floor.append(thread_cpu(dict_miss, cache, fresh) / n)
            us, fl = statistics.median(ours) * 1e6, statistics.median(floor) * 1e6
            cases.append(
                {
                    "pages": pages,
                    "cycle": cycle,
                    "us_per_page": round(us, 3),
                    "floor_us_per_page": round(fl, 3),
                    "ratio": round(us / fl, 2),
                    "spread": [round(min(ours) * 1e6, 3), round(max(ours) * 1e6, 3)],
                }
            )
            print(
                f"  {pages:>8} pages {cycle:>4}: {us:7.2f} us/page, floor {fl:5.2f}, ratio {us / fl:5.1f}",
                file=sys.stderr,
            )
        del core, cache
        gc.collect()
    return cases, memory


def insert_cost(repeats: int) -> dict[str, Any]:
    """Insert 2 new pages after a short and after a long context: time per insert call."""
    out: dict[str, Any] = {}
    for context in (14, 140):
        samples = []
        for r in range(repeats):
            core = CacheCore(CacheConfig(page_size=PAGE, device_pages=20_000))
            reqs = [sequence(r * 1000 + i, context + 2) for i in range(50)]
            for tokens in reqs:
                core_miss(core, tokens[: context * PAGE])
            t = t_append = 0.0
            for i, tokens in enumerate(reqs):
                lease, match = core.lock(tokens)
                have = list(match.device_page_ids)
                if i % 2:  # the whole sequence to insert
                    fresh = core.alloc(lease, 2)
                    start = time.thread_time()
                    core.insert(lease, tokens, have + fresh)
                    t += time.thread_time() - start
                else:  # the context inserted (the lease's sequence), then its next 2 pages alone
                    core.insert(lease, tokens[: context * PAGE], have[:context])
                    fresh = core.alloc(lease, 2)
                    start = time.thread_time()
                    core.append(lease, tokens[context * PAGE :], fresh)
                    t_append += time.thread_time() - start
                core.release(lease)
                drain(core)
            samples.append((2 * t / len(reqs), 2 * t_append / len(reqs)))
        out[f"context_{context}_us"] = round(statistics.median(s[0] for s in samples) * 1e6, 2)
        out[f"append_{context}_us"] = round(statistics.median(s[1] for s in samples) * 1e6, 2)
    out["ratio_long_to_short"] = round(out["context_140_us"] / out["context_14_us"], 2)
    out["append_ratio_long_to_short"] = round(out["append_140_us"] / out["append_14_us"], 2)
    return out


def engine_step(
    cached_pages: int, running: int, completing: int, whole: bool = False, steps: int = 5
) -> tuple[list[float], list[float]]:
    """CPU seconds of ``steps`` scheduler steps in a row (each: alloc(2) + append of 2 new pages for
    ``completing`` of the ``running`` requests, then one round; ``whole``: match + alloc(2) + insert
    of the whole sequence instead) for the core and for the floor, the two alternating step by step."""
    pool = cached_pages + running * (CONTEXT_PAGES + 2 * steps + 8)
    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=pool))
    cache = DictPrefixCache(pool)
    for i in range(cached_pages // CONTEXT_PAGES):
        core_miss(core, sequence(i, CONTEXT_PAGES))
        dict_miss(cache, sequence(i, CONTEXT_PAGES))
    # Running requests: each holds a lease (core) or references (floor) on its context.
    leases, contexts, held, dkeys = [], [], [], []
    for j in range(running):
        tokens = sequence(5_000_000 + j, CONTEXT_PAGES)
        lease, match = core.lock(tokens)
        pages = core.alloc(lease, CONTEXT_PAGES)
        core.insert(lease, tokens, pages)
        leases.append([lease, pages])
        keys = cache.keys(tokens)
        dpages = cache.alloc(len(keys))
        cache.insert(keys, dpages)
        held.append(dpages)
        dkeys.append(keys)
        contexts.append(tokens)
    drain(core)
    gc.collect()

    rnd = Round(core)

    def one_round() -> None:
        """The round as one rank runs it, every copy landed (a one-rank all-reduce returns the vector)."""
        landed = {op.op_id: op.num_pages for queue in core.inflight.values() for op in queue}
        rnd.commit(rnd.prepare(rnd.number, landed, 0, True))
        if core.has_ready():  # what the driver hands the I/O
            core.ready()
            core.advance()

    def core_step(news: list[list[int]]) -> None:
        for j in range(completing):
            lease, pages = leases[j]
            fresh = core.alloc(lease, 2)
            pages += fresh
            if whole:  # the whole sequence, as an engine without append gives it
                tokens = contexts[j] = contexts[j] + news[j]
                core.match(tokens)
                core.insert(lease, tokens, pages)
            else:
                core.append(lease, news[j], fresh)
        one_round()

    def dict_step(news: list[list[int]]) -> None:
        # An engine hashes a request's new pages only (it keeps the keys of the ones before).
        for j in range(completing):
            new = news[j]
            parent = dkeys[j][-1]
            keys = []
            for i in range(0, len(new), PAGE):
                parent = hash((parent, tuple(new[i : i + PAGE])))
                keys.append(parent)
            dkeys[j] += keys
            pages = cache.alloc(2)
            held[j] += pages
            cache.insert(keys, pages)

    ours, floor = [], []
    for step in range(steps):
        # The step's new tokens, made before it is timed (an engine has them from its sampler).
        news = [sequence(7_000_000 + step * 100_000 + j * 1000 + CONTEXT_PAGES, 2) for j in range(completing)]
        start = time.thread_time()
        core_step(news)
        ours.append(time.thread_time() - start)
        start = time.thread_time()
        dict_step(news)
        floor.append(time.thread_time() - start)
    return ours, floor


# ---------------------------------------------------------------------- measurement helpers


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class gc_pauses:
    """Collect the duration of every garbage collection while the block runs (gc.callbacks): wall
    time into ``into``, this thread's CPU time into ``cpu`` (a loaded machine stretches the former
    when it preempts the process mid-collection)."""

    def __init__(self, into: list[float], cpu: list[float] | None = None) -> None:
        self.into, self.cpu, self.start, self.start_cpu = into, cpu, 0.0, 0.0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.start, self.start_cpu = time.perf_counter(), time.thread_time()
        else:
            self.into.append(time.perf_counter() - self.start)
            if self.cpu is not None:
                self.cpu.append(time.thread_time() - self.start_cpu)

    def __enter__(self) -> gc_pauses:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def run_peers(args: argparse.Namespace) -> int:
    """``--peers``: one line naming the peer and why when one cannot run (exit 2)."""
    import core_peers

    args.peers = args.peers or list(core_peers.PEERS)
    try:
        out = core_peers.run(args)
    except core_peers.PeerError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps({"peers": out}) if args.json else json.dumps({"peers": out}, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (--peers: passes per cache)")
    ap.add_argument("--requests", type=int, default=20, help="requests per timed cycle")
    ap.add_argument("--step-pages", type=int, default=625_000)
    ap.add_argument("--steps", type=int, default=5, help="engine steps timed in a row (medians reported)")
    ap.add_argument("--json", action="store_true")
    peers = ap.add_argument_group(
        "--peers",
        "the core beside vLLM and SGLang on a trace: every cache holds --cache-tokens worth of pages, starts "
        "each pass empty, serves the same requests one at a time and hits at most the prompt less one token; "
        "passes interleaved (--repeats), thread CPU time (scripts/core_peers.py says more)",
    )
    peers.add_argument("--peers", nargs="*", choices=["vllm", "sglang"], help="the peers to run (none named: both)")
    peers.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace (default: %(default)s)")
    peers.add_argument("--trace-requests", type=int, default=3000, help="its first N requests are the stream")
    peers.add_argument("--page-sizes", type=int, nargs="+", default=[16, 512])
    peers.add_argument("--cache-tokens", type=int, default=3_000_000, help="every cache holds this many tokens' pages")
    peers.add_argument("--gc-pages", type=int, default=1_000_000, help="cached pages for the GC figure (0: none)")
    peers.add_argument("--gc-caches", nargs="+", choices=["native", "reference", "dict", "vllm", "sglang"])
    peers.add_argument("--gc-rounds", type=int, default=5, help="interleaved empty/built rounds of the GC figure")
    peers.add_argument("--vllm-python", default=sys.executable, help="the interpreter with vLLM")
    peers.add_argument("--sglang-python", default=str(SGLANG_PYTHON), help="the interpreter with SGLang")
    args = ap.parse_args()
    if args.peers is not None:
        for name in ("repeats", "trace_requests", "cache_tokens"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be at least 1")
        if min(args.page_sizes) < 1 or args.cache_tokens < max(args.page_sizes):
            ap.error("--page-sizes must be at least 1 and --cache-tokens at least the largest page size")
        return run_peers(args)
    print(f"resource: max RSS before {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB", file=sys.stderr)
    cases, memory = cycle_cases(args.sizes, args.repeats, args.requests)
    insert = insert_cost(args.repeats)
    med = statistics.median
    full_ours, full_floor = engine_step(args.step_pages, 256, 256, steps=args.steps)
    sparse_ours, sparse_floor = engine_step(args.step_pages, 256, 16, steps=args.steps)
    whole_ours, _ = engine_step(args.step_pages, 256, 256, whole=True, steps=args.steps)
    step = {
        "ms": round(med(full_ours) * 1e3, 2),
        "floor_ms": round(med(full_floor) * 1e3, 2),
        "ratio": round(med(full_ours) / med(full_floor), 2),
        "spread_ms": [round(min(full_ours) * 1e3, 2), round(max(full_ours) * 1e3, 2)],
        "sparse_ms": round(med(sparse_ours) * 1e3, 3),
        "sparse_floor_ms": round(med(sparse_floor) * 1e3, 3),
        "sparse_spread_ms": [round(min(sparse_ours) * 1e3, 3), round(max(sparse_ours) * 1e3, 3)],
        "whole_insert_ms": round(med(whole_ours) * 1e3, 2),
        "steps": args.steps,
    }
    out = {"cases": cases, "insert": insert, "step": step, **memory}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
