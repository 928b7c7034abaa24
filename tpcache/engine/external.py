"""EngineCache: one tpcache rank under an engine that owns its device KV blocks (vLLM's block pool).

The rank holds the host tier (L2) and, optionally, the storage tier (L3); the engine's blocks stay
the engine's (or, with ``device_adopt``, the engine's pages are the core's device tier: SGLang's KV
pool). It is a ``TPCache`` whose core has no device tier of its own and whose transfer engine copies
between host slots and the block ids the engine names (``tpcache.io.engine_kv``). Everything
else is the embedded cache as it is: the same sequenced operations, one round per ``step()``,
fail-closed on any disagreement.

Sequenced operations beyond ``TPCache``'s: ``save`` (blocks -> host, for the pages not cached yet)
and ``load_into`` (the lease's hit -> blocks). Their ops' ``acked`` is filled by the round that
agrees them; ``outcome`` reads it. A lease's release waits for both kinds: no copy ever writes
into pages already given back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from tpcache.comm.collective import Collective
from tpcache.core import CacheConfig, CacheCore, Transfer
from tpcache.core.hashing import TokenIds
from tpcache.core.hitrule import hit_length
from tpcache.engine.driver import Driver
from tpcache.engine.sequenced import Op
from tpcache.engine.shell import Shell, storage_key_factory
from tpcache.engine.tpcache import KV_FORMAT_VERSION, TPCache
from tpcache.io.engine_kv import AfterCopy, CopyHook, EngineKV, EngineTransfer, HoldHook, LayerDelay
from tpcache.io.kv_pool import HostPool, KVLayout
from tpcache.io.storage import StorageBackend, StorageWorker


def engine_layout_version(layout: KVLayout, engine_format: str) -> int:
    """A stable id of an engine's page byte format: storage never mixes two formats or layouts."""
    fields = (KV_FORMAT_VERSION, engine_format, layout.num_layers, layout.heads_per_rank, layout.head_dim)
    desc = "/".join(str(f) for f in (*fields, layout.dtype, layout.page_size))
    return xxhash.xxh32_intdigest(desc.encode()) & 0x7FFFFFFF


class EngineCache(TPCache):
    def __init__(
        self,
        config: CacheConfig,
        collective: Collective,
        engine_kv: EngineKV,
        kv_layout: KVLayout,
        *,
        engine_format: str,
        storage: StorageBackend | None = None,
        round_timeout_s: float = 30.0,
        before_copy: CopyHook = None,
        after_copy: AfterCopy = None,
        hold: HoldHook = None,
        layered: bool = False,
        layer_delay: LayerDelay = None,
    ) -> None:
        """``kv_layout`` describes one host page (this rank's shard of one engine block over every
        layer); ``engine_format`` names the engine's byte order (part of every storage key).
        ``layered``: copies issued inside an engine step go by layer (``EngineTransfer``).
        ``before_copy``, ``after_copy``, ``hold``, ``layer_delay``: test hooks of the transfer
        (``tpcache.io.engine_kv``)."""
        if config.device_pages != 0 and not config.device_adopt:
            raise ValueError(
                "an engine-owned cache has no device tier of its own: set device_pages=0 (or device_adopt "
                "to make the engine's pages the device tier)"
            )
        if config.host_pages <= 0:
            raise ValueError("an engine-owned cache needs a host tier: set host_pages > 0")
        if kv_layout.page_size != config.page_size:
            raise ValueError(f"KV layout page size {kv_layout.page_size} != cache page size {config.page_size}")
        if storage is not None and not config.storage:
            config = CacheConfig(**{**config.to_dict(), "storage": True})
        if config.storage and storage is None:
            raise ValueError("config.storage is set but no storage backend was given")
        # The base class builds a metadata-only rank; the tiers, the shell and the driver are
        # replaced below.
        super().__init__(
            CacheConfig(**{**config.to_dict(), "storage": False}), collective, round_timeout_s=round_timeout_s
        )
        self.config = config
        self.kv_layout = kv_layout
        self.engine_kv = engine_kv
        self.host_pool = HostPool(kv_layout, config.host_pages, "page_first")
        transfer: Any = EngineTransfer(
            engine_kv,
            self.host_pool,
            before_copy=before_copy,
            after_copy=after_copy,
            hold=hold,
            layered=layered,
            layer_delay=layer_delay,
        )
        self.transfer: EngineTransfer = transfer
        worker = key_of = None
        if storage is not None:
            worker = StorageWorker(storage)
            version = engine_layout_version(kv_layout, engine_format)
            key_of = storage_key_factory(config.namespace, version, self.shard)
        self.storage = storage
        self.shell = Shell(transfer, self.host_pool, worker, key_of)
        self.driver = Driver(CacheCore(config), self.shell, collective, rank=self.rank, round_timeout_s=round_timeout_s)
        self.round = self.driver.round

    def save(self, lease: int, tokens: TokenIds, blocks: Sequence[int]) -> Transfer | None:
        """Back up the full pages of ``tokens`` not cached yet from the engine's ``blocks``."""
        return self.driver.apply(Op("save", (lease, tokens, list(blocks))))

    def load_into(self, lease: int, first_page: int, blocks: Sequence[int]) -> Transfer | None:
        """Copy pages ``first_page..`` of the lease's hit into the engine's ``blocks``."""
        return self.driver.apply(Op("load_into", (lease, first_page, list(blocks))))

    def hit_pages(self, lease: int) -> int:
        """The lease's hit in pages: leading host pages it holds (pure; agreed once a round passed open)."""
        return self.core.hit_pages(lease)

    def state_hit_pages(self, lease: int, limit: int) -> int:
        """The lease's hit in pages, at most ``limit``, ended at the last page that carries its
        recurrent state (the hit rule's fixed point, ``tpcache.core.hitrule``; the hit itself
        without a state group). Pure: reads the flags of pages held on host."""
        held = min(self.core.hit_pages(lease), limit)
        if self.engine_kv.state_flag_part is None:
            return held
        slots = self.core.hit_host_slots(lease)[:held]
        return hit_length(held, state_ok=self.engine_kv.state_flags(self.transfer.host, slots))

    def filling(self, tokens: TokenIds, page: int) -> bool:
        """Whether page ``page`` of ``tokens`` is being copied into host (a save or another
        request's storage read) and may become a hit shortly. Pure."""
        return self.core.host_filling(tokens, page)

    def lease_alive(self, lease: int) -> bool:
        return self.core.has_lease(lease)

    def outcome(self, op: Transfer | None) -> int | None:
        """Pages of ``op`` agreed landed on every rank; None while it is still in flight. An op an
        agreed flush dropped never completes: it counts as failed (0)."""
        if op is None:
            return 0
        if op.acked >= 0:
            return op.acked
        return None if self.core.op_in_flight(op.kind, op.op_id) else 0
