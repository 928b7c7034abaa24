"""``--radix-cache-backend tpcache``: SGLang's prefix cache as one tpcache rank per TP scheduler.

SGLang's device KV pool is tpcache's device tier (``CacheConfig.device_adopt``): a tpcache page is
one page of SGLang's KV pool (``--page-size`` tokens; page id = KV index // page size), and the
tpcache core decides which of them stay cached. SGLang's allocator still hands pages to requests;
when SGLang checkpoints a request the core adopts its pages (``adopt``), and what the core evicts
or gives back goes to SGLang's allocator in the order the core freed it, the same on every rank.
A request's tree lock is a tpcache lease (its pins). Every call the scheduler makes on the cache is
a sequenced operation or a pure query of the core; the round runs once per scheduler step that ran a
batch (``flush_pending_backups``, which SGLang calls after each batch), on SGLang's TP CPU group
(shared memory when the ranks share a host). tpcache adds no other collective.

With a host tier (``TPCACHE_SGLANG_HOST_PAGES`` > 0), every page the tree adopts is copied to host
(write-through: the core's backups, each rank copying its own shard out of SGLang's KV buffers), so a
page evicted from SGLang's pool stays cached on host. A match whose tail is on host only returns
that tail as SGLang's ``host_hit_length``; SGLang's admission then calls ``init_load_back``, which
takes pages from SGLang's allocator (evicting as SGLang would), copies the host pages into them
before it returns (an agreed, sequenced ``load_adopted``: the same on every rank) and adopts them,
so the request's forward reads them as any cached prefix. A load that cannot be served (its pages
changed, or no pages to load into) is a miss: the request computes those tokens.

With a storage tier (``TPCACHE_SGLANG_STORAGE``, a file store; it needs the host tier), every page
backed up to host is also written to storage, and a fresh engine on the same store finds them there.
SGLang holds a request back for a storage read only under its own HiCache, so the read is
opportunistic: when ``match_prefix`` sees a prompt whose cached prefix ends before its full pages do,
the backend locks the prompt and starts the core's agreed storage prefetch (the hit is the minimum
over ranks, agreed in the per-step round; a failed read is a miss). The request is not held: one
admitted before the read lands computes its tokens; one still waiting (SGLang matches every waiting
request when it has room to admit one, ``supports_fast_match_prefix``) finds the pages on host at a
later match and loads them back as any host hit. The prefetch's lease is released once it is done.

Served: full-attention models, page size > 1, the device and host tiers. Refused at start, in one line:
SGLang's hybrid caches (sliding-window, Mamba), page size 1, EAGLE's bigram keys, HiCache, a
disabled radix cache. Requests with an ``extra_key`` (LoRA) or a ``cache_salt`` match only pages
cached under the same ones (``keys.Namespaces``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)

from tpcache.core import CacheClosed, CacheConfig
from tpcache.core.hashing import as_token_bytes
from tpcache.engine.driver import GroupBroken
from tpcache.integrations.sglang.keys import Namespaces
from tpcache.integrations.sglang.options import (
    FAULTS_ENV,
    HOST_ENV,
    STORAGE_ENV,
    parse_faults,
    parse_host_pages,
    parse_storage,
    refusal,
)

log = logging.getLogger("tpcache.sglang")


@dataclass(frozen=True)
class Prefix:
    """A match's handle (SGLang keeps it as ``req.last_node``): the matched tokens (int32 bytes)
    and their device pages when matched. Stable while a lease pins the pages."""

    tokens: bytes
    pages: tuple[int, ...]

    @property
    def children(self) -> dict:
        return {}


ROOT = Prefix(b"", ())
STORE_BYTES = 64 << 30  # the file store's capacity (it evicts its oldest segments past it)
TRIED_MAX = 4096  # prompts whose storage lookup started; forgotten all at once past this many


def build(ctx: Any) -> TPCacheRadix:
    """The factory SGLang calls in each scheduler process (``plugin.factory``)."""
    params = ctx.params
    policy = (params.eviction_policy or "lru").lower()
    reason = refusal(
        hybrid_swa=bool(ctx.is_hybrid_swa),
        hybrid_ssm=bool(ctx.is_hybrid_ssm),
        page_size=int(params.page_size),
        eagle=bool(params.is_eagle),
        hicache=bool(ctx.enable_hierarchical_cache),
        disabled=bool(ctx.disable_radix_cache or params.disable),
        eviction_policy=policy,
    )
    if reason is not None:
        raise ValueError(reason)
    faults = parse_faults(os.environ.get(FAULTS_ENV, ""))
    host_pages = parse_host_pages(os.environ.get(HOST_ENV, ""))
    store = parse_storage(os.environ.get(STORAGE_ENV, ""), host_pages)
    from tpcache.comm import make_collective

    group = ctx.tp_group.cpu_group if ctx.tp_group is not None else None
    collective = make_collective("auto", group=group)
    storage = None
    if store is not None:
        from pathlib import Path

        from tpcache.io.storage import FileBackend

        rank, world = int(ctx.tp_rank), int(ctx.tp_size)
        storage = FileBackend(Path(store) / f"rank{rank}", capacity_bytes=STORE_BYTES, shard=(rank, world))
    cache = TPCacheRadix(params, collective, policy, host_pages=host_pages, storage=storage)
    cache.namespaces = Namespaces(cache.page_size, int(ctx.model_config.vocab_size))
    cache.faults = {kind: f["first_token"] for kind, f in faults.items() if f["rank"] == ctx.tp_rank}
    return cache


def engine_kv_of(pool: Any, page_size: int) -> tuple[Any, Any, str]:
    """SGLang's MHA KV pool as tpcache's ``EngineKV`` (each layer's K and V buffers, one row per
    page), the ``KVLayout`` of one host page (this rank's shard of a page over every layer) and the
    byte format's name. Any other pool: one line."""
    from tpcache.io.engine_kv import EngineKV
    from tpcache.io.kv_pool import KVLayout

    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    heads, dim, v_dim = (getattr(pool, a, None) for a in ("head_num", "head_dim", "v_head_dim"))
    num_tokens = int(getattr(pool, "size", 0)) + page_size
    usable = (
        isinstance(k, list) and isinstance(v, list) and k and len(k) == len(v) and dim == v_dim
        and all(t.is_contiguous() and t.dim() == 3 and t.shape[0] == num_tokens for t in (*k, *v))
    )  # fmt: skip
    if not usable:
        raise ValueError(
            f"{HOST_ENV} needs SGLang's MHA KV pool ([tokens, heads, head_dim] K and V buffers per layer, "
            f"equal K and V head sizes); this engine has {type(pool).__name__}: set {HOST_ENV}=0"
        )
    pages = num_tokens // page_size
    parts = [buf.view(pages, -1) for pair in zip(k, v, strict=True) for buf in pair]
    layers = [i // 2 for i in range(len(parts))]
    layout = KVLayout(len(k), int(heads), int(dim), k[0].dtype, page_size)
    return EngineKV(parts, layers=layers), layout, f"sglang-mha-{k[0].dtype}"


class TPCacheRadix(BasePrefixCache):
    def __init__(
        self, params: Any, collective: Any, eviction_policy: str = "lru", host_pages: int = 0, storage: Any = None
    ) -> None:
        from tpcache.engine.tpcache import TPCache

        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = ps = int(params.page_size)
        allocator = self.token_to_kv_pool_allocator
        # SGLang's page ids run 1 .. num_pages (page 0 holds the padding slot).
        self.config = CacheConfig(
            page_size=ps,
            device_pages=allocator.size // ps + 1,
            device_adopt=True,
            host_pages=host_pages,
            eviction_policy=eviction_policy,
        )
        if host_pages:
            from tpcache.engine.external import EngineCache

            kv, layout, fmt = engine_kv_of(allocator.get_kvcache(), ps)
            self.rank: Any = EngineCache(self.config, collective, kv, layout, engine_format=fmt, storage=storage)
        else:
            self.rank = TPCache(self.config, collective)
        dev = allocator.device
        self.device = torch.device(dev) if isinstance(dev, str | torch.device) else torch.device("cpu")
        self._offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        self.root_node = ROOT
        self.stats = dict.fromkeys(
            ("rounds", "evicted_pages", "returned_pages", "duplicate_pages", "loaded_pages", "prefetches"), 0
        )
        self.namespaces: Namespaces | None = None  # keys of requests with an extra_key or cache_salt
        self.faults: dict[str, int] = {}  # test faults of this rank (options.parse_faults): kind -> first token
        self.storage = storage is not None
        self.prefetching: dict[bytes, int] = {}  # prompt -> the lease of its storage prefetch (in order)
        self.tried: set[bytes] = set()  # prompts whose storage lookup started (membership only)

    # ------------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """SGLang's ``flush_cache`` (every scheduler, idle, no request running): an agreed flush,
        in a round of its own. SGLang clears its allocator right after, so the dropped tree's
        pages are not handed back one by one."""
        self._release_prefetches(every=True)
        self.tried.clear()
        self.rank.request_flush()
        self.rank.step()
        self.rank.drain_returned()

    def flush_pending_backups(self) -> None:
        """Called by SGLang's scheduler once after each batch: tpcache's round for this step. A round
        whose collective failed (a rank died or stopped answering) ends this scheduler: its TP group
        cannot run another step, and SGLang's scheduler stops the engine on the error."""
        self.rank.step()
        self.stats["rounds"] += 1
        if self.rank.driver.broken is not None:
            why = self.rank.driver.broken
            raise GroupBroken(f"tpcache: a TP rank died or stopped answering ({why}); restart the engine")
        self._release_prefetches()
        self._give_back()

    def _release_prefetches(self, every: bool = False) -> None:
        """Release the leases of storage prefetches that are done (agreed state: alike on every
        rank); what they read stays on host, where a later match finds it."""
        for data, lease in list(self.prefetching.items()):
            try:
                status = self.rank.prefetch_status(lease)[0]
            except KeyError:  # UnknownLease: it went with a closed cache's reset
                status = "gone"
            if every or status not in ("querying", "deferred", "reading"):
                del self.prefetching[data]
                with contextlib.suppress(CacheClosed, ValueError, KeyError):  # gone with a closed cache
                    self.rank.release(lease)

    def _prefetch(self, data: bytes) -> None:
        """Start an agreed storage prefetch of a prompt's pages past its cached prefix (once per
        prompt). Every rank matches the same waiting requests in the same order, so every rank
        applies the same lock and prefetch."""
        if data in self.tried:
            return
        if len(self.tried) >= TRIED_MAX:
            self.tried.clear()
        self.tried.add(data)
        try:
            lease, _ = self.rank.lock(data)
        except CacheClosed:
            return
        try:
            started = self.rank.prefetch(lease)
        except CacheClosed:
            started = False
        if started:
            self.prefetching[data] = lease
            self.stats["prefetches"] += 1
        else:
            self.rank.release(lease)
            self._give_back()

    def supports_fast_match_prefix(self) -> bool:
        """A match is a query of the core: SGLang may match every waiting request each pass it has
        room to admit one (which is when a storage prefetch for a queued request starts)."""
        return True

    # ------------------------------------------------------------------ matching and locks

    def _tokens(self, key: Any) -> bytes | None:
        if key.is_bigram:
            return None
        return self._key(key.raw_token_ids(), key.extra_key, key.cache_salt)

    def _key(self, ids: Any, extra_key: str | None, cache_salt: str | None) -> bytes | None:
        """The tree key of the whole pages of ``ids``, in the request's namespace (None: uncached)."""
        n = len(ids) // self.page_size * self.page_size
        if not n:
            return None
        if extra_key is None and not cache_salt:
            return as_token_bytes(ids[:n])
        return self.namespaces.key(ids[:n], extra_key, cache_salt or None) if self.namespaces else None

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The device prefix (``last_device_node``) and, past it, the pages on host only
        (``best_match_node``, ``host_hit_length``), which ``init_load_back`` brings back."""
        data = self._tokens(params.key)
        handle = best = ROOT
        if data is not None:
            found = self.rank.match(data)
            step = self.page_size * 4
            if found.device_pages:
                handle = best = Prefix(data[: found.device_pages * step], tuple(found.device_page_ids))
            if found.host_pages:
                best = Prefix(data[: (found.device_pages + found.host_pages) * step], handle.pages)
            if self.storage and (found.device_pages + found.host_pages) * step < len(data):
                self._prefetch(data)
        return MatchResult(
            device_prefix_len=len(handle.pages) * self.page_size,
            last_device_node=handle,
            last_host_node=best,
            best_match_node=best,
            host_hit_length=(len(best.tokens) - len(handle.tokens)) // 4,
        )

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Prefix]:
        """SGLang admits a request whose match has a host-only tail: take pages for it from SGLang's
        allocator, copy the host pages into them and adopt them (a sequenced ``load_adopted``), all
        before returning; returns (tokens loaded, the new match). A tail that changed since the
        match, or no pages to load into, loads nothing: the request computes those tokens."""
        req, best, ps = params.req, params.best_match_node, self.page_size
        current = req.last_node
        n = int(params.host_hit_length) // ps
        if n <= 0 or type(best) is not Prefix:
            return 0, current
        try:
            lease, found = self.rank.lock(best.tokens)
        except CacheClosed:
            return 0, current
        try:
            if tuple(found.device_page_ids) != best.pages or found.host_pages < n:
                return 0, current  # evicted meanwhile: a miss, never other KV
            allocator = self.token_to_kv_pool_allocator
            need = n * ps
            if allocator.available_size() < need:
                self.evict(EvictParams(num_tokens=need - allocator.available_size()))
            index = allocator.alloc(need) if allocator.available_size() >= need else None
            if index is None:
                return 0, current
            pages = (index[::ps].to(torch.int64) // ps).tolist()
            try:
                op = self.rank.load_adopted(lease, pages)
            except BaseException as exc:  # refused (nothing changed): the pages are SGLang's again
                allocator.free(index)
                if isinstance(exc, CacheClosed):
                    return 0, current
                raise
            if self.rank.shell.landed().get(op.op_id) != n:
                raise RuntimeError(
                    f"tpcache: copying {n} pages from the host tier into SGLang's KV pool failed on this rank; "
                    "stopping rather than serving KV that is not there"
                )
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the forward may run on another stream
            self.stats["loaded_pages"] += n
            return need, Prefix(best.tokens, best.pages + tuple(pages))
        finally:
            self.rank.release(lease)  # the pins stay until the load is agreed; the admission locks it
            self._give_back()

    def inc_lock_ref(self, node: Prefix) -> IncLockRefResult:
        lease, found = self.rank.lock(node.tokens)
        if tuple(found.device_page_ids) != node.pages:
            self.rank.release(lease)
            self._give_back()
            raise RuntimeError(
                f"tpcache: a match of {len(node.pages)} pages was locked after its pages changed "
                f"({len(found.device_page_ids)} found): the scheduler must lock a match before it evicts"
            )
        return IncLockRefResult(delta=-len(node.pages) * self.page_size, node_id=lease)

    def dec_lock_ref(self, node: Prefix, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if params is None or params.node_id is None:
            raise ValueError("tpcache: dec_lock_ref needs the receipt of inc_lock_ref (the lease)")
        self.rank.release(params.node_id)
        self._give_back()
        return DecLockRefResult(delta=0)

    def path_device_indices(self, node: Prefix) -> torch.Tensor:
        if not node.pages:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        pages = torch.tensor(node.pages, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    # ------------------------------------------------------------------ inserts

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Adopt the request's computed pages into tpcache's tree, free the ones already cached
        under other pages, point the request's row at the tree's pages and move its anchor."""
        ps = self.page_size
        token_ids = req.full_untruncated_fill_ids[:up_to]
        ours = type(req.last_node) is Prefix and req.lock is not None
        data = self._key(token_ids, req.extra_key, req.cache_salt) if ours else None
        if data is None:
            return
        n = len(data) // (4 * ps)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        pages = (row[: n * ps : ps].to(torch.int64) // ps).tolist()
        lease = req.lock.receipt.node_id
        try:
            left = self.rank.adopt(lease, data, pages)
        except CacheClosed:
            return  # a closed cache keeps nothing: the request's pages stay its own
        finally:
            self._give_back()
        if left:
            self.stats["duplicate_pages"] += len(left)
            self._free_pages(left)
        if self.faults.get("kill") == token_ids[0]:
            log.warning("tpcache: test fault: TP scheduler pid %d kills itself", os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.get("diverge") == token_ids[0]:
            del self.faults["diverge"]  # once: an operation the other ranks do not apply
            log.warning("tpcache: test fault: this rank applies an operation the others do not")
            self.rank.release(self.rank.lock(data)[0])
            self._give_back()
        found = self.rank.match(data)
        cached = tuple(found.device_page_ids)
        protected = req.kv.cache_protected_len
        if len(cached) * ps > protected:
            indices = self.path_device_indices(Prefix(b"", cached))
            self.req_to_token_pool.write(
                (req.kv.req_pool_idx, slice(protected, len(indices))), indices[protected:].to(row.dtype)
            )
            req.kv.cache_protected_len = len(indices)
        handle = Prefix(data[: len(cached) * ps * 4], cached)
        req.last_node = handle
        req.lock = TreeLock(handle, req.lock.receipt)

    # ------------------------------------------------------------------ eviction

    def evict(self, params: EvictParams) -> EvictResult:
        want = -(-int(params.num_tokens) // self.page_size)
        if want <= 0:
            return EvictResult()
        self.rank.evict_device(want)
        freed = self._give_back()
        self.stats["evicted_pages"] += freed
        return EvictResult(num_tokens_evicted=freed * self.page_size)

    def _give_back(self) -> int:
        """Hand the pages the core freed back to SGLang's allocator, in the order it freed them."""
        pages = self.rank.drain_returned()
        if pages:
            self.stats["returned_pages"] += len(pages)
            self._free_pages(pages)
        return len(pages)

    def _free_pages(self, pages: list[int]) -> None:
        index = torch.tensor(pages, dtype=torch.int64, device=self.device) * self.page_size
        self.token_to_kv_pool_allocator.free(index)

    # ------------------------------------------------------------------ sizes and introspection

    def evictable_size(self) -> int:
        return self.rank.core.evictable_device_tokens

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        return self.rank.core.protected_device_tokens

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return self.rank.core.pages_in_use()[0] * self.page_size

    def cached_pages(self) -> int:
        """tpcache's device tier: SGLang pages the tree holds now."""
        return self.rank.core.pages_in_use()[0]

    def all_values_flatten(self) -> torch.Tensor:
        return self.path_device_indices(Prefix(b"", self.rank.core.adopted_pages()))

    def pretty_print(self) -> None:
        print(f"tpcache: {self.total_size()} tokens cached on device; {self.rank.health()}")

    def dfs_weight_order(self, node_handles: Any) -> list[int]:
        return list(range(len(node_handles)))
