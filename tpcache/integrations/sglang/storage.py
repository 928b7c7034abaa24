"""tpcache's storage backends as SGLang HiCache's L3 tier (``interface_v1``: batch get and set
straight between the store and SGLang's host pool).

Selected with SGLang's dynamic storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tpcache",
        "module_path": "tpcache.integrations.sglang.storage", "class_name": "TPCacheHiCacheStorage",
        "interface_v1": 1, "storage_url": "file:///var/cache/tpcache"}'

``storage_url`` is any tpcache storage URL (``file://``, ``redis://``, ``mooncake://``).

What tpcache adds to SGLang's own backends: every record carries a header and payload checksum and
echoes its key, and a record that is damaged, truncated, written by another rank, another layout
or another page size is a miss, never bytes handed to the model. A page is the pieces SGLang's
host pool keeps it in (its K and V, per layer in the layer-first layout); each piece is one
record, read and written in place in the host pool (no staging copy), and the page counts as
stored or read only when every one of its pieces is.
"""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Any

import xxhash

from tpcache.comm.parallel import Shard
from tpcache.io.storage import StorageKey, StorageURLError, open_storage, parse_storage_url
from tpcache.io.storage.url import parse_size

try:  # the base class exists only where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # pragma: no cover - imported for its docs or by a tool without SGLang
    HiCacheStorage = object  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

_SETTINGS = ("backend_name", "module_path", "class_name", "interface_v1", "storage_url", "namespace", "capacity")
_NAMESPACE_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
# Bumped when the way a page is split into records changes, so old records are never read as new.
_RECORD_SCHEME = 1


class TPCacheHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a tpcache storage backend, for one TP rank's shard."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(_SETTINGS) - {"tp_lcm_size"})
        if unknown:
            raise ValueError(
                f"tpcache's HiCache storage has no setting {unknown[0]!r} in --hicache-storage-backend-extra-config; "
                f"known: {', '.join(_SETTINGS)}"
            )
        if not extra.get("interface_v1"):
            raise ValueError(
                'tpcache\'s HiCache storage needs "interface_v1": 1 in --hicache-storage-backend-extra-config '
                "(it reads and writes SGLang's host pool in place)"
            )
        url = extra.get("storage_url")
        if not url:
            raise ValueError(
                'tpcache\'s HiCache storage needs "storage_url" in --hicache-storage-backend-extra-config: '
                "file:///PATH, redis://HOST:PORT/DB or mooncake://HOST:PORT?metadata=URL"
            )
        try:
            spec = parse_storage_url(url)
            capacity = parse_size(str(extra.get("capacity", "1GiB")))
        except StorageURLError as exc:
            raise ValueError(f"--hicache-storage-backend-extra-config: {exc}") from None
        if getattr(storage_config, "should_split_heads", False) or getattr(storage_config, "dcp_size", 1) > 1:
            raise ValueError(
                "tpcache's HiCache storage keeps one record set per TP rank; it does not serve split-head "
                "or decode-context-parallel layouts"
            )
        self.shard = Shard(
            storage_config.tp_rank,
            storage_config.tp_size,
            storage_config.pp_rank,
            storage_config.pp_size,
            storage_config.attn_cp_rank,
            storage_config.attn_cp_size,
        )
        namespace = extra.get("namespace") or storage_config.model_name or "sglang"
        self.namespace = _NAMESPACE_SAFE.sub("-", str(namespace))[-100:].strip("-.") or "sglang"
        self.backend = open_storage(spec, shard=tuple(self.shard), capacity_bytes=capacity)
        self.mem_pool_host = None
        self._pieces = 0
        self._layout_version = 0
        logger.info("tpcache HiCache storage: %s, shard %s", spec.describe(), self.shard.label)

    # -- the host pool ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.page_size
        _, sizes = mem_pool_host.get_page_buffer_meta(_first_page(page))
        self._pieces = len(sizes)
        # Everything that decides what a page's bytes mean: a record written under another layout,
        # dtype, head count, page size or split is another key, so it is never read as this one.
        geometry = (
            _RECORD_SCHEME,
            type(mem_pool_host).__name__,
            getattr(mem_pool_host, "layout", ""),
            str(getattr(mem_pool_host, "dtype", "")),
            page,
            tuple(sizes),
        )
        self._layout_version = xxhash.xxh3_64_intdigest(repr(geometry).encode()) & 0x7FFFFFFF

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        # The full-attention KV pool is the one register_mem_pool_host laid out; any other pool
        # (sliding-window KV, Mamba state, a draft model's KV) would need the v2 batch calls.
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv":
            raise ValueError(
                f"tpcache's HiCache storage serves full-attention KV pages only; this model also keeps "
                f"{name!r} pages in HiCache: use one of SGLang's own storage backends for it"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _keys(self, key: str) -> list[StorageKey]:
        out = []
        for piece in range(self._pieces):
            page_hash = xxhash.xxh3_64_intdigest(f"{key}#{piece}".encode())
            out.append(StorageKey.of(self.namespace, self._layout_version, self.shard, page_hash))
        return out

    def _views(self, host_indices: Any, pages: int) -> list[memoryview]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * self._pieces:
            raise ValueError(f"{pages} keys but host indices for {len(ptrs) // max(self._pieces, 1)} pages")
        return [memoryview((ctypes.c_char * n).from_address(p)).cast("B") for p, n in zip(ptrs, sizes, strict=True)]

    def _per_page(self, results: list[bool], pages: int) -> list[bool]:
        k = self._pieces
        return [all(results[i * k : (i + 1) * k]) for i in range(pages)]

    # -- interface_v1 ---------------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        skeys = [sk for key in keys for sk in self._keys(key)]
        ok = self.backend.get(skeys, self._views(host_indices, len(keys)))
        return _leading(self._per_page(ok, len(keys)))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        skeys = [sk for key in keys for sk in self._keys(key)]
        views = self._views(host_indices, len(keys))
        present = self.backend.exists(skeys)
        todo = [i for i, p in enumerate(present) if not p]
        ok = list(present)
        if todo:
            for i, r in zip(todo, self.backend.put([skeys[i] for i in todo], [views[i] for i in todo]), strict=True):
                ok[i] = r
        return self._per_page(ok, len(keys))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        found = self._per_page(self.backend.exists([sk for key in keys for sk in self._keys(key)]), len(keys))
        return found.index(False) if False in found else len(found)

    def exists(self, key: str) -> bool:
        return all(self.backend.exists(self._keys(key)))

    # -- the copying interface, which this backend does not serve --------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("tpcache's HiCache storage serves interface_v1 only")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("tpcache's HiCache storage serves interface_v1 only")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("tpcache's HiCache storage serves interface_v1 only")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None):
        raise NotImplementedError("tpcache's HiCache storage serves interface_v1 only")

    # -- the rest -------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """tpcache's storage counters (hits, misses by reason, puts, bytes used), per piece."""
        return self.backend.stats()

    def clear(self) -> None:
        # The store may be shared with other engines and ranks: records leave it by its own
        # eviction (a file store's capacity) or the store's tools, never by one engine's reset.
        logger.warning(
            "tpcache HiCache storage: clearing the storage tier leaves the store's records in place "
            "(other engines may share them); empty the store with its own tools"
        )

    def close(self) -> None:
        self.backend.close()


def _first_page(page_size: int) -> Any:
    import torch

    return torch.arange(page_size, dtype=torch.int64)


def _leading(per_page: list[bool]) -> list[bool]:
    """A page after a missed one is reported missed too: SGLang uses the leading run only, and a
    later page's bytes must not be mistaken for loaded."""
    out, ok = [], True
    for r in per_page:
        ok = ok and r
        out.append(ok)
    return out
