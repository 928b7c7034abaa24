#!/usr/bin/env python3
"""``bench_core.py --peers``: the core beside vLLM's KVCacheManager and SGLang's RadixCache.

Five caches serve the same request stream, the first ``--trace-requests`` requests of a
Mooncake-format trace (token ids made from its block hashes, ``tpcache.workload.trace``), one
request at a time as an engine's scheduler would: look up the longest cached prefix, allocate pages
for the rest, cache the request's full pages, release it.

- ``native`` and ``reference``: tpcache's core on each tree core (``TPCACHE_TREE_CORE``): lock,
  alloc, insert, release and the drain that stands in for the round, the token ids converted to
  int32 key bytes inside the clock;
- ``dict``: the floor of ``bench_core.py`` keyed by the hash of the parent's key and the page's
  int32 bytes (a bytes-keyed dict with reference counts and an LRU);
- ``vllm``: ``KVCacheManager`` with its block pool and prefix caching on, ``block_size`` the page
  size, driven as vLLM's scheduler drives it: the request's block hashes (vLLM's request block
  hasher with the engine's default hash, ``sha256``), ``get_computed_blocks``, ``allocate_slots``,
  ``free``; the ``Request`` object itself is made outside the clock;
- ``sglang``: ``RadixCache`` as shipped in SGLang 0.5.23, with its ``page_size``, on SGLang's own
  ``PagedTokenToKVPoolAllocator`` (the allocator SGLang builds for a non-disaggregated server): a
  match of the prompt capped as SGLang's scheduler caps it, ``path_device_indices`` for the hit,
  ``inc_lock_ref``, ``evict`` when the allocator is short, ``alloc``, ``insert`` of the full pages,
  the freeing of pages the insert found already cached and of the partial last page,
  ``dec_lock_ref``. The allocator is built without a KV pool (``kvcache=None``): alloc and free only
  hand out and take back indices, and neither the allocator nor the tree ever reads the pool, so
  the CPU measured is the tree's and its allocator's, not the model's memory.

Made comparable: every cache holds the same number of pages (``--cache-tokens`` / page size; vLLM
gets one block more, the null block its pool keeps back), starts empty for each pass, and sees the
same stream, so each is under the same eviction pressure. A hit is capped at the prompt's length
minus one token for all five (vLLM's manager and SGLang's scheduler recompute the last token to
get its logits), and counted in whole pages. What still differs is each cache's own policy: vLLM
evicts a freed request's last blocks first, SGLang a whole least recently used leaf (a run of
pages), tpcache and the dict single pages; the hit rates printed side by side show what that costs.

Each cache runs in a process of its own (the reference core is chosen when tpcache is imported,
and SGLang lives in its own interpreter, ``.venv-sglang``, loaded with the torchvision and
sgl_kernel stand-ins of ``tests/sglang/shims`` that its import chain needs on a CPU-only machine;
the radix cache never calls them). The passes are interleaved, one cache at a time, and each pass's
thread CPU time is summed over the requests, the token ids made outside the clock. torch runs on
one thread (``OMP_NUM_THREADS=1``): SGLang's tree keeps its pages' indices in small CPU tensors
here (on a GPU server they live on the device), and a thread pool would only spin on a shared
machine. CPU per page is over the stream's full pages; medians of ``--repeats`` passes with their
spread.

The GC figure, in each cache's process (``gc_figure`` says why it is measured so): one workload
(200,000 small objects made and dropped, then five full collections forced by ``gc.collect()``,
each timed through ``gc.callbacks``) runs beside a fresh empty cache sized for ``--gc-pages`` pages
and beside a fresh cache built to ``--gc-pages`` cached pages of 16 tokens (requests of 140 pages
sharing none, each then served once more, a hit), alternately, in ``--gc-rounds`` rounds, with what
the process held before frozen (``gc.freeze()``). Each round's difference is the longest full
(generation 2) collection beside the built cache minus that beside the empty one; the figure is the
median of the rounds' differences with their spread, in this thread's CPU time and in wall time.
Every half's longest pause and number of full collections are kept, and a half that saw none fails
the run, so the figure cannot read 0 by never collecting.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES = ("native", "reference", "dict", "vllm", "sglang")
PEERS = ("vllm", "sglang")
SGLANG_SHIMS = REPO / "tests" / "sglang" / "shims"  # torchvision/sgl_kernel stand-ins, as the SGLang ring uses
GC_FORCED = 5  # full collections the GC workload forces (it may see more)
TAG = "BENCH "  # protocol lines from a worker start with this; anything else a library prints is ignored


# ---------------------------------------------------------------------- the five caches, one request each


class Tpcache:
    def __init__(self, page_size: int, pages: int) -> None:
        from tpcache.core import CacheConfig, CacheCore
        from tpcache.core.hashing import as_token_bytes
        from tpcache.replay import drain

        self.core = CacheCore(CacheConfig(page_size=page_size, device_pages=pages))
        self.ps, self.as_bytes, self.drain = page_size, as_token_bytes, drain

    def prepare(self, tokens: array, i: int) -> array:
        return tokens

    def serve(self, tokens: array) -> int:
        core, ps = self.core, self.ps
        data = self.as_bytes(tokens)
        n = len(tokens)
        lease, match = core.lock(data if n % ps else data[:-4])  # a hit leaves the last token to compute
        have = match.device_page_ids
        missing = n // ps - len(have)
        core.insert(lease, data, have + core.alloc(lease, missing) if missing > 0 else have)
        core.release(lease)
        self.drain(core)
        return len(have) * ps


class Dict:
    def __init__(self, page_size: int, pages: int) -> None:
        from bench_core import DictPrefixCache

        self.cache, self.step, self.ps = DictPrefixCache(pages), 4 * page_size, page_size

    def prepare(self, tokens: array, i: int) -> array:
        return tokens

    def serve(self, tokens: array) -> int:
        cache, step = self.cache, self.step
        data = tokens.tobytes()
        keys, parent = [], 0
        for i in range(0, len(data) - step + 1, step):
            parent = hash((parent, data[i : i + step]))
            keys.append(parent)
        hit = cache.match(keys[: (len(tokens) - 1) // self.ps])
        pages = hit + cache.alloc(len(keys) - len(hit))
        cache.insert(keys, pages)
        cache.release(pages)
        return len(hit) * self.ps


class Vllm:
    def __init__(self, page_size: int, pages: int) -> None:
        import torch
        from vllm import SamplingParams
        from vllm.config import CacheConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.algo = CacheConfig().prefix_caching_hash_algo  # the engine's default
        hash_fn = get_hash_fn_by_name(self.algo)
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=pages + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=1 << 22,
            scheduler_block_size=page_size,
            hash_block_size=page_size,
            enable_caching=True,
        )
        self.hasher, self.Request, self.params = (
            get_request_block_hasher(page_size, hash_fn),
            Request,
            SamplingParams(max_tokens=1),
        )

    def prepare(self, tokens: array, i: int) -> Any:
        return self.Request(f"r{i}", tokens.tolist(), self.params, None)

    def serve(self, request: Any) -> int:
        m = self.manager
        request.block_hashes.extend(self.hasher(request))  # what Request() does with the engine's hasher
        blocks, computed, _ = m.get_computed_blocks(request)
        if (
            m.allocate_slots(
                request, request.num_tokens - computed, num_new_computed_tokens=computed, new_computed_blocks=blocks
            )
            is None
        ):
            raise RuntimeError("vLLM's block pool could not hold one request: raise --cache-tokens")
        request.num_computed_tokens = request.num_tokens
        m.free(request)
        return computed


class Sglang:
    def __init__(self, page_size: int, pages: int) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.alloc = PagedTokenToKVPoolAllocator(
            page_size * pages, page_size, torch.float16, "cpu", kvcache=None, need_sort=False
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc, page_size=page_size
            )
        )
        self.ps, self.torch, self.Key = page_size, torch, RadixKey
        self.Match, self.Insert, self.Evict = MatchPrefixParams, InsertParams, EvictParams

    def prepare(self, tokens: array, i: int) -> array:
        return array("q", tokens)  # SGLang's requests hold their ids as array('q')

    def serve(self, ids: array) -> int:
        tree, alloc, ps, n = self.tree, self.alloc, self.ps, len(ids)
        match = tree.match_prefix(self.Match(key=self.Key(ids, limit=n - 1)))
        prefix, node = match.device_prefix_len, match.last_device_node
        hit = tree.path_device_indices(node)[:prefix]
        lock = tree.lock(node)  # inc_lock_ref
        need = -(-(n - prefix) // ps) * ps
        if alloc.available_size() < need:
            tree.evict(self.Evict(num_tokens=need - alloc.available_size()))
        fresh = alloc.alloc(need)
        if fresh is None:
            raise RuntimeError("SGLang's allocator could not hold one request: raise --cache-tokens")
        row = self.torch.cat((hit, fresh))
        cached = tree.insert(self.Insert(key=self.Key(ids), value=row)).prefix_len
        alloc.free_segment(row[prefix:cached], start_pos=prefix)  # computed again, already in the tree
        full = n // ps * ps
        alloc.free_segment(row[full:], start_pos=full)  # the partial last page
        tree.unlock(lock)  # dec_lock_ref
        return prefix


CACHES = {"native": Tpcache, "reference": Tpcache, "dict": Dict, "vllm": Vllm, "sglang": Sglang}


# ---------------------------------------------------------------------- one worker process per cache


def one_pass(engine: str, page_size: int, pages: int, requests: list) -> dict[str, Any]:
    """A fresh cache serves the whole stream; the clock runs around ``serve`` only."""
    from tpcache.workload.trace import request_tokens

    cache = CACHES[engine](page_size, pages)
    cpu = 0.0
    hit = tokens_in = full = 0
    for i, req in enumerate(requests):
        tokens = request_tokens(req)
        if len(tokens) < 2:
            continue
        x = cache.prepare(tokens, i)
        start = time.thread_time()
        hit += cache.serve(x)
        cpu += time.thread_time() - start
        tokens_in += len(tokens)
        full += len(tokens) // page_size
    del cache
    return {"cpu_s": cpu, "pages": full, "hit_tokens": hit, "input_tokens": tokens_in}


def full_pauses(cpu: list[float], wall: list[float]) -> Any:
    """A gc callback recording each full (generation 2) collection's thread CPU and wall time."""
    start = [0.0, 0.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            start[:] = [time.thread_time(), time.perf_counter()]
        else:
            cpu.append(time.thread_time() - start[0])
            wall.append(time.perf_counter() - start[1])

    return cb


def gc_workload() -> dict[str, Any]:
    """The same work beside either cache: garbage made and dropped (young collections), then
    ``GC_FORCED`` full collections forced and timed. The longest full pause and how many ran; a run
    that saw no full collection raises ``GcError`` (its figure would read 0 by never collecting)."""
    cpu: list[float] = []
    wall: list[float] = []
    cb = full_pauses(cpu, wall)
    gc.callbacks.append(cb)
    try:
        for _ in range(10):
            junk = [(i, [i]) for i in range(20_000)]
            del junk
        for _ in range(GC_FORCED):
            gc.collect()
    finally:
        gc.callbacks.remove(cb)
    if not cpu:
        raise GcError(f"the GC workload saw no full collection after {GC_FORCED} gc.collect() calls")
    return {"full_collections": len(cpu), "max_cpu_ms": max(cpu) * 1e3, "max_wall_ms": max(wall) * 1e3}


def context_tokens(n: int) -> Any:
    """Request ``i``'s token ids for ``i`` in ``range(n)``, equal to ``array("i", sequence(i,
    CONTEXT_PAGES))`` of ``bench_core`` but sliced from one ring of ids instead of made an int at a
    time (a rebuilt cache would otherwise spend most of its build making them)."""
    from bench_core import CONTEXT_PAGES, PAGE

    length, period = CONTEXT_PAGES * PAGE, 50_000
    ring = array("i", range(period))
    ring.extend(ring[:length])
    for i in range(n):
        start = (i * 31 + 1) % period
        tokens = array("i", [i])
        tokens.extend(ring[start : start + length - 1])
        yield tokens


def gc_half(engine: str, pages: int, build: bool) -> dict[str, Any]:
    """One cache sized for ``pages`` pages (plus one request), the only cache alive while
    ``gc_workload`` runs beside it, torn down after. Built, it holds ``pages`` cached pages (requests
    of ``CONTEXT_PAGES`` pages sharing none), each request then served once more, a hit: a cache is
    built to be hit, and what a lookup leaves behind (tpcache's run caches, SGLang's touched nodes)
    is part of what a collection walks. Empty, it serves nothing."""
    from bench_core import CONTEXT_PAGES

    cache = CACHES[engine](16, pages + CONTEXT_PAGES)
    n = pages // CONTEXT_PAGES if build else 0
    for i, tokens in enumerate(context_tokens(n)):
        cache.serve(cache.prepare(tokens, i))
    for i, tokens in enumerate(context_tokens(n)):
        cache.serve(cache.prepare(tokens, n + i))
    gc.collect()  # the build's own garbage is not the workload's
    out = gc_workload()
    del cache
    gc.collect()
    return out


def gc_figure(engine: str, pages: int, rounds: int) -> dict[str, Any]:
    """The longest full-collection pause beside a cache built to ``pages`` cached pages minus the
    same workload's beside an empty cache, measured ``rounds`` times in this one process.

    Each round runs two halves: one beside a fresh empty cache of the same config, one beside a
    fresh cache built to ``pages`` pages (``gc_half``); only that cache is alive during its half,
    and it is torn down and collected before the next. The halves alternate which goes first, so a
    machine whose speed drifts (a full collection here takes 1 ms one second and 5 ms a few seconds
    later, in this thread's CPU time, on a shared machine) moves both alike. Why not build once and
    compare against the process before building: one such pair measures the drift between the two,
    seconds apart, as much as the cache. Why not keep an empty cache beside the built one: the
    built one would then be in the empty half's collections too. Why one process: the
    interpreter's own objects and memory layout are the same in both halves, and separate
    processes differ by more than the figure.

    What the process held before (its imports, the trace) is frozen first (``gc.freeze()``), as
    vLLM's engine core does after start-up and SGLang does on request: both halves leave it alike,
    and without it SGLang's imports alone make each full collection last about 300 ms, whose noise
    would swamp the figure. A warm-up half runs first and is not counted.

    The figure is the median over rounds of (built minus empty), each side its longest full pause
    (generation 2), in thread CPU time and in wall time, with the spread over rounds; every half's
    longest pause and number of full collections are kept. A half without a full collection fails
    the run (``GcError``), so the figure cannot read 0 by never collecting."""
    import statistics

    from bench_core import CONTEXT_PAGES

    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    try:
        gc_half(engine, pages, build=False)  # warm-up: the workload's first run sets up the allocator
        halves: dict[str, list[dict[str, Any]]] = {"empty": [], "built": []}
        for r in range(rounds):
            for side in ("empty", "built") if r % 2 == 0 else ("built", "empty"):
                halves[side].append(gc_half(engine, pages, build=side == "built"))
    finally:
        gc.unfreeze()
    out: dict[str, Any] = {"cached_pages": pages // CONTEXT_PAGES * CONTEXT_PAGES, "rounds": rounds, **halves}
    for clock in ("cpu", "wall"):
        pairs = zip(halves["empty"], halves["built"], strict=True)
        diffs = [b[f"max_{clock}_ms"] - e[f"max_{clock}_ms"] for e, b in pairs]
        out[f"figure_{clock}_ms"] = statistics.median(diffs)
        out[f"spread_{clock}_ms"] = [min(diffs), max(diffs)]
        for side in ("empty", "built"):
            out[f"{side}_{clock}_ms"] = statistics.median(h[f"max_{clock}_ms"] for h in halves[side])
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def worker(engine: str, trace: str, limit: int) -> int:
    """Answer one JSON command a line on stdin (``pass`` or ``gc``) with one tagged JSON line."""
    try:
        if engine in PEERS and importlib.util.find_spec(engine) is None:
            return say({"error": f"{engine} is not installed for {sys.executable}"})
        probe = CACHES[engine](16, 64)  # imports the cache's library and builds one: a missing peer fails here
        from tpcache.workload.trace import load_trace

        requests = list(load_trace(trace, limit))
    except Exception as exc:  # noqa: BLE001 -- reported to the parent in one line
        return say({"error": f"cannot run under {sys.executable}: {type(exc).__name__}: {exc}".splitlines()[0]})
    extra = {"vllm_hash": probe.algo} if isinstance(probe, Vllm) else {}
    del probe
    say({"ready": True, **extra})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "pass":
            say(one_pass(engine, cmd["page_size"], cmd["pages"], requests))
        else:
            try:
                say(gc_figure(engine, cmd["pages"], cmd["rounds"]))
            except GcError as exc:
                say({"error": str(exc)})
    return 0


def say(reply: dict[str, Any]) -> int:
    sys.stdout.write(TAG + json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0


def die_with_parent() -> None:
    """In a worker before it starts (Linux): the kernel kills it when the benchmark's process ends."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Worker:
    """A cache's process, started at once; ``ask`` sends a command and waits for its answer."""

    def __init__(self, engine: str, python: str, trace: str, limit: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["TPCACHE_TREE_CORE"] = "reference" if engine == "reference" else "native"
        if engine == "sglang":
            env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_SHIMS), env["PYTHONPATH"]])
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # torch on the scheduler's thread alone
        env.setdefault("PYTHONHASHSEED", "0")  # vLLM's non-crypto hashes and the dict's hash() alike each run
        self.engine, self.log = engine, tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 -- closed in close()
        argv = [python, str(Path(__file__).resolve()), "--worker", engine, trace, str(limit)]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": self.log}
        self.proc = subprocess.Popen(argv, **pipes, text=True, env=env, preexec_fn=die_with_parent)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        self.proc.wait()
        self.log.seek(0)
        tail = [ln.strip() for ln in self.log.read().splitlines() if ln.strip()]
        return {"error": f"its process exited ({self.proc.returncode}): {tail[-1] if tail else 'no output'}"}

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self.read()
        if "error" in reply:
            raise PeerError(f"bench_core --peers: {self.engine}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class PeerError(RuntimeError):
    """A peer cannot run here; the message is one line naming it and why."""


class GcError(RuntimeError):
    """The GC figure cannot be measured: a workload saw no full collection."""


def start(
    engines: list[str], pythons: dict[str, str], trace: str, limit: int
) -> tuple[dict[str, Worker], dict[str, Any]]:
    """One worker per cache, each ready; a peer that cannot run raises PeerError (the others are stopped)."""
    for peer in PEERS:
        if peer in engines and not Path(pythons[peer]).exists():
            hint = " (make setup-sglang)" if peer == "sglang" else ""
            raise PeerError(f"bench_core --peers: {peer}: no interpreter at {pythons[peer]}{hint}")
    workers = {e: Worker(e, pythons.get(e, sys.executable), trace, limit) for e in engines}
    info: dict[str, Any] = {}
    try:
        for e, w in workers.items():
            reply = w.read()
            if "error" in reply:
                why = reply["error"]
                raise PeerError(f"bench_core --peers: {e}: {why}")
            info.update({k: v for k, v in reply.items() if k != "ready"})
    except PeerError:
        for w in workers.values():
            w.close()
        raise
    return workers, info


# ---------------------------------------------------------------------- the measurement and its table


def summarize(engines: list[str], passes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import statistics

    rows: dict[str, Any] = {}
    for e in engines:
        us = [p["cpu_s"] / p["pages"] * 1e6 for p in passes[e]]
        first = passes[e][0]
        rows[e] = {
            "us_per_page": round(statistics.median(us), 4),
            "spread": [round(min(us), 4), round(max(us), 4)],
            "hit_rate": round(first["hit_tokens"] / first["input_tokens"], 4),
            "same_hits_every_pass": all(p["hit_tokens"] == first["hit_tokens"] for p in passes[e]),
        }
    for e in engines:
        for floor in ("sglang", "dict"):
            if floor in rows:
                rows[e][f"x_{floor}"] = round(rows[e]["us_per_page"] / rows[floor]["us_per_page"], 2)
    return rows


def run(args: Any) -> dict[str, Any]:
    trace = Path(args.trace)
    if not trace.exists():
        raise PeerError(f"bench_core --peers: the trace {trace} does not exist; pass --trace PATH")
    if args.gc_rounds < 1:
        raise PeerError(f"bench_core --peers: --gc-rounds is {args.gc_rounds}; it must be at least 1")
    engines = [e for e in ENGINES if e not in PEERS or e in args.peers]
    pythons = {"vllm": args.vllm_python, "sglang": args.sglang_python}
    workers, info = start(engines, pythons, str(trace), args.trace_requests)
    out: dict[str, Any] = {"trace": str(trace), "requests": args.trace_requests, "cache_tokens": args.cache_tokens}
    out.update(repeats=args.repeats, engines=engines, **info, page_sizes={})
    try:
        for ps in args.page_sizes:
            pages = args.cache_tokens // ps
            passes: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for r in range(args.repeats):
                order = engines[r % len(engines) :] + engines[: r % len(engines)]  # no cache always first
                for e in order:
                    passes[e].append(workers[e].ask(op="pass", page_size=ps, pages=pages))
            first = passes[engines[0]][0]
            out["page_sizes"][str(ps)] = {
                "cache_pages": pages,
                "stream_pages": first["pages"],
                "engines": summarize(engines, passes),
            }
            print_table(ps, out, sys.stderr)
        gc_caches = args.gc_caches or engines
        if args.gc_pages:
            out["gc"] = {
                "pages": args.gc_pages,
                "rounds": args.gc_rounds,
                "engines": {
                    e: workers[e].ask(op="gc", pages=args.gc_pages, rounds=args.gc_rounds)
                    for e in engines
                    if e in gc_caches
                },
            }
            print_gc(out["gc"], sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    return out


def print_table(ps: int, out: dict[str, Any], fh: Any) -> None:
    d = out["page_sizes"][str(ps)]
    print(
        f"{ps}-token pages: {d['cache_pages']:,}-page caches, {out['requests']} requests "
        f"({d['stream_pages']:,} pages), medians of {out['repeats']} interleaved passes, thread CPU time",
        file=fh,
    )
    print(f"  {'cache':<10} {'us/page':>8} {'spread':>17} {'x sglang':>9} {'x dict':>7} {'hit rate':>9}", file=fh)
    for e, row in d["engines"].items():
        spread = f"{row['spread'][0]:.3f}-{row['spread'][1]:.3f}"
        xs = f"{row['x_sglang']:.2f}" if "x_sglang" in row else "-"
        print(
            f"  {e:<10} {row['us_per_page']:>8.3f} {spread:>17} {xs:>9} {row['x_dict']:>7.2f} {row['hit_rate']:>9.4f}",
            file=fh,
        )


def print_gc(g: dict[str, Any], fh: Any) -> None:
    print(
        f"longest full collection, {g['pages']:,} cached pages of 16 tokens minus an empty cache (ms), "
        f"medians of {g['rounds']} interleaved rounds:",
        file=fh,
    )
    head = f"  {'cache':<10} {'cpu':>8} {'spread':>15} {'wall':>8} {'empty cpu':>10} {'built cpu':>10} {'full GCs':>9}"
    print(head, file=fh)
    for e, r in g["engines"].items():
        spread = f"{r['spread_cpu_ms'][0]:.2f}..{r['spread_cpu_ms'][1]:.2f}"
        fulls = [h["full_collections"] for side in ("empty", "built") for h in r[side]]
        print(
            f"  {e:<10} {r['figure_cpu_ms']:>8.2f} {spread:>15} {r['figure_wall_ms']:>8.2f} "
            f"{r['empty_cpu_ms']:>10.2f} {r['built_cpu_ms']:>10.2f} {min(fulls):>9}",
            file=fh,
        )


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(worker(sys.argv[2], sys.argv[3], int(sys.argv[4])))
