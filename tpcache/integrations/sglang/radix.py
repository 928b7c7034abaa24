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

Served: full-attention models, page size > 1, the device tier. Refused at start, in one line:
SGLang's hybrid caches (sliding-window, Mamba), page size 1, EAGLE's bigram keys, HiCache, a
disabled radix cache. Requests with an ``extra_key`` (LoRA) or a ``cache_salt`` match only pages
cached under the same ones (``keys.Namespaces``).
"""

from __future__ import annotations

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
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)

from tpcache.core import CacheClosed, CacheConfig
from tpcache.core.hashing import as_token_bytes
from tpcache.engine.driver import GroupBroken
from tpcache.integrations.sglang.keys import Namespaces
from tpcache.integrations.sglang.options import FAULTS_ENV, parse_faults, refusal

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
    from tpcache.comm import make_collective

    group = ctx.tp_group.cpu_group if ctx.tp_group is not None else None
    collective = make_collective("auto", group=group)
    cache = TPCacheRadix(params, collective, policy)
    cache.namespaces = Namespaces(cache.page_size, int(ctx.model_config.vocab_size))
    cache.faults = {kind: f["first_token"] for kind, f in faults.items() if f["rank"] == ctx.tp_rank}
    return cache


class TPCacheRadix(BasePrefixCache):
    def __init__(self, params: Any, collective: Any, eviction_policy: str = "lru") -> None:
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
            host_pages=0,
            eviction_policy=eviction_policy,
        )
        self.rank = TPCache(self.config, collective)
        dev = allocator.device
        self.device = torch.device(dev) if isinstance(dev, str | torch.device) else torch.device("cpu")
        self._offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        self.root_node = ROOT
        self.stats = {"rounds": 0, "evicted_pages": 0, "returned_pages": 0, "duplicate_pages": 0}
        self.namespaces: Namespaces | None = None  # keys of requests with an extra_key or cache_salt
        self.faults: dict[str, int] = {}  # test faults of this rank (options.parse_faults): kind -> first token

    # ------------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """SGLang's ``flush_cache`` (every scheduler, idle, no request running): an agreed flush,
        in a round of its own. SGLang clears its allocator right after, so the dropped tree's
        pages are not handed back one by one."""
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
        self._give_back()

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
        data = self._tokens(params.key)
        handle = ROOT
        if data is not None:
            found = self.rank.match(data)
            if found.device_pages:
                pages = tuple(found.device_page_ids)
                handle = Prefix(data[: len(pages) * self.page_size * 4], pages)
        return MatchResult(
            device_prefix_len=len(handle.pages) * self.page_size,
            last_device_node=handle,
            last_host_node=handle,
            best_match_node=handle,
        )

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
