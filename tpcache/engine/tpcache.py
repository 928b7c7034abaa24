"""TPCache: one cache rank, embedded in an engine's TP worker or run by the service.

Every rank of the TP group calls the same sequenced operations in the same order (an engine's TP
workers do by construction; the service's ranks do because rank 0 orders the requests), then
``step()`` once per scheduler step. ``step`` is the round: exactly one all-reduce, issued
unconditionally by every rank from the calling (main) thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tpcache.comm.collective import Collective
from tpcache.comm.parallel import GroupShapeError, ParallelGroup
from tpcache.core import CacheConfig, CacheCore
from tpcache.core.round import RoundReport
from tpcache.engine.driver import Driver, Operations
from tpcache.engine.sequenced import Op
from tpcache.engine.shell import PartIO, Shell, storage_key_factory
from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout
from tpcache.io.storage import StorageBackend, StorageWorker, open_storage
from tpcache.io.transfer import LoadHandle, TransferEngine

log = logging.getLogger("tpcache.engine")

KV_FORMAT_VERSION = 1


def layout_version(layout: KVLayout, component: str = "", group: ParallelGroup | None = None) -> int:
    """A stable id of the page byte format: storage never reads pages written in another layout.
    A component's data (``component``: "swa", "mamba") has its own id, so its keys never meet the
    full pages' keys or another component's. A group with pipeline stages or context ranks adds its
    shape (``PP2xTP2``), so a store written by one shape is never read by another; plain TP keeps
    the id it always had (its stores stay readable)."""
    fields = (KV_FORMAT_VERSION, layout.num_layers, layout.heads_per_rank, layout.head_dim, layout.dtype)
    desc = "/".join(str(f) for f in (*fields, layout.page_size))
    if component:
        desc += f"/{component}"
    if group is not None and (group.pp_size > 1 or group.cp_size > 1):
        desc += f"/{group.name}"
    return xxhash.xxh32_intdigest(desc.encode()) & 0x7FFFFFFF


@dataclass
class LoadResult:
    device_pages: list[int]  # the lease's device prefix, loading pages included
    handles: list[LoadHandle]  # every load its pages wait for: its own, and others' it shares
    part_handles: list[LoadHandle] = field(default_factory=list)  # component loads it waits for

    @property
    def handle(self) -> LoadHandle | None:
        """The latest load the prefix waits for (None when nothing is loading)."""
        return self.handles[-1] if self.handles else None

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of every page of the prefix has landed (a forward pass's layer i)."""
        for handle in self.handles:
            handle.wait_layer(layer, timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every copy the hit waits for has landed: full pages and component data."""
        for handle in self.handles + self.part_handles:
            handle.wait(timeout)


class TPCache(Operations):
    def __init__(
        self,
        config: CacheConfig,
        collective: Collective,
        *,
        kv_layout: KVLayout | None = None,
        device_pool: DevicePool | None = None,
        host_layout: str = "page_first",
        device: Any = None,
        storage: StorageBackend | str | None = None,
        round_timeout_s: float = 30.0,
        transfer_threads: int | None = 1,
        transfer_delay: Any = None,
        part_layouts: Mapping[str, KVLayout] | None = None,
        group: ParallelGroup | None = None,
        model_id: str | None = None,
    ) -> None:
        """``storage``: a backend, or a storage URL (file://, mooncake://, redis://) opened for this
        rank's shard. ``transfer_delay``: test hook passed to the TransferEngine (seconds, or op id
        -> seconds). ``part_layouts``: for a hybrid model, the layout of each component's data by
        name ("swa": the sliding-window layers' KV per page, page size as the cache's; "mamba": one
        state per "page", see ``kv_pool.state_layout``), with ``kv_layout`` the full-attention
        layers'. ``group``: the shape of the group (``ParallelGroup(pp_size=2, tp_size=2)``; default
        plain TP over the collective's ranks): this rank's place in it (``self.shard``) follows from
        its global rank, ``kv_layout`` is its slice of a page (its stage's layers, its heads, with
        context ranks its share of a page's tokens) and its storage keys carry that place.
        ``model_id``: store pages in the shared layout (``io.storage.sharded``): as shards of the
        model's global KV heads and layers under the model's id, which groups of any TP or PP shape
        of the same model read (``storage``: a URL, or a backend that serves every shard); None keeps
        the per-shape layout, whose keys name this rank's place."""
        group = ParallelGroup(tp_size=collective.world_size) if group is None else group
        if group.world_size != collective.world_size:
            raise GroupShapeError(
                f"{group.name} needs {group.world_size} ranks, but the collective has {collective.world_size}"
            )
        self.group = group
        self.shard = group.place(collective.rank)
        if model_id is not None and storage is not None:
            storage = self._shared_storage(model_id, storage, kv_layout, part_layouts)
        elif isinstance(storage, str):
            storage = open_storage(storage, shard=self.shard)
        if storage is not None and not config.storage:
            config = CacheConfig(**{**config.to_dict(), "storage": True})
        if config.storage and storage is None:
            raise ValueError("config.storage is set but no storage backend was given")
        self.config = config
        self.collective = collective
        self.rank = collective.rank
        self.world_size = collective.world_size
        self.round_timeout_s = round_timeout_s
        core = CacheCore(config)
        self.round_seconds: deque[float] = deque(maxlen=4096)  # recent round wall times (metrics only)
        self.events: Any = None  # rank 0's KV-event stream (``publish_events``)
        self.kv_layout = kv_layout
        self.device_pool = device_pool
        self.host_pool: HostPool | None = None
        transfer = worker = key_of = None
        if kv_layout is not None:
            if kv_layout.page_size * group.cp_size != config.page_size:
                raise ValueError(self._page_size_error("KV layout", kv_layout.page_size, config.page_size))
            if self.device_pool is None:
                self.device_pool = DevicePool(kv_layout, config.device_pages, device)
            if self.device_pool.num_pages < config.device_pages:
                raise ValueError(
                    f"device pool has {self.device_pool.num_pages} pages, config needs {config.device_pages}"
                )
            self.host_pool = HostPool(kv_layout, max(config.host_pages, 1), host_layout)
            transfer = TransferEngine(self.device_pool, self.host_pool, threads=transfer_threads, delay=transfer_delay)
            if storage is not None:
                worker = StorageWorker(storage)
                version = layout_version(kv_layout, group=group)
                key_of = storage_key_factory(config.namespace, version, self.shard)
        elif storage is not None:
            raise ValueError("the storage tier needs a KV layout (pages have bytes to store)")
        self.storage = storage  # owned: closed with the cache
        self.part_pools: dict[str, tuple[DevicePool, HostPool]] = {}
        parts = self._part_io(config, part_layouts or {}, device, host_layout, transfer_threads, storage is not None)
        self.shell = Shell(transfer, self.host_pool, worker, key_of, parts)
        described = self._describe_layouts(part_layouts or {})
        self.driver = Driver(
            core, self.shell, collective, rank=self.rank, round_timeout_s=round_timeout_s, kv_layout=described
        )
        self.round = self.driver.round

    def _shared_storage(
        self,
        model_id: str,
        storage: StorageBackend | str,
        layout: KVLayout | None,
        parts: Mapping[str, KVLayout] | None,
    ) -> StorageBackend:
        """The shard-layout view of ``storage`` for this rank (see ``io.storage.sharded``)."""
        from tpcache.io.storage.sharded import ModelShape, ShardedStorage, open_shared_storage

        if layout is None:
            raise ValueError("the storage tier needs a KV layout (pages have bytes to store)")
        if parts:
            raise ValueError(
                "model_id (the shared storage layout) stores full-attention pages only; a hybrid model's "
                f"components ({', '.join(sorted(parts))}) need the per-shape layout (no model_id)"
            )
        model = ModelShape.of_rank(model_id, layout, self.shard)
        if isinstance(storage, str):
            return open_shared_storage(storage, model=model, shard=self.shard, layout=layout)
        return ShardedStorage(storage, model, self.shard, layout)

    def _part_io(
        self,
        config: CacheConfig,
        layouts: Mapping[str, KVLayout],
        device: Any,
        host_layout: str,
        threads: int | None,
        storage: bool,
    ) -> dict[int, PartIO]:
        """Pools and a transfer engine per component of a hybrid model (with a KV layout)."""
        specs = config.components()
        unknown = set(layouts) - {s.name for s in specs}
        if unknown:
            raise ValueError(f"layouts given for components the configuration does not declare: {sorted(unknown)}")
        if self.kv_layout is None:
            return {}
        out: dict[int, PartIO] = {}
        for spec in specs:
            layout = layouts.get(spec.name)
            if layout is None:
                raise ValueError(f"the {spec.name} component needs its layout (part_layouts[{spec.name!r}])")
            if spec.is_window and layout.page_size * self.group.cp_size != config.page_size:
                raise ValueError(self._page_size_error(f"{spec.name} layout", layout.page_size, config.page_size))
            if not spec.is_window and config.mamba_state_bytes and layout.page_bytes != config.mamba_state_bytes:
                raise ValueError(
                    f"mamba layout holds {layout.page_bytes} bytes a state, config says {config.mamba_state_bytes}"
                )
            dev = DevicePool(layout, spec.device_slots, device)
            host = HostPool(layout, max(spec.host_slots, 1), host_layout)  # type: ignore[arg-type]
            self.part_pools[spec.name] = (dev, host)
            key_of = None
            if storage:
                version = layout_version(layout, spec.name, self.group)
                key_of = storage_key_factory(config.namespace, version, self.shard)
            out[spec.index] = PartIO(TransferEngine(dev, host, threads=threads), host, key_of, spec.is_window)
        return out

    def _page_size_error(self, what: str, layout_tokens: int, page_size: int) -> str:
        if self.group.cp_size == 1:
            return f"{what} page size {layout_tokens} != cache page size {page_size}"
        return (
            f"{what} holds {layout_tokens} tokens a page, but each of {self.group.cp_size} context ranks "
            f"holds {page_size / self.group.cp_size:g} of a {page_size}-token page"
        )

    def _describe_layouts(self, layouts: Mapping[str, KVLayout]) -> str:
        """What the round's layout field covers beside the configuration: the group's shape and
        every component's KV layout (equal on every rank of a well-formed group: a stage's slice
        differs from another's only in which layers, never in their number)."""
        described: dict[str, object] = {"group": self.group.name}
        if self.kv_layout is not None:
            named = {"full": self.kv_layout, **layouts}
            described.update(
                {name: layout_version(lay, "" if name == "full" else name, self.group) for name, lay in named.items()}
            )
        return json.dumps(described)

    @property
    def seq(self) -> int:
        return self.driver.seq

    # ------------------------------------------------------------------ sequenced operations

    def load(self, lease: int) -> LoadResult:
        """Start loading the lease's host hits to device; wait per layer on the result's handles
        (with components: ``wait`` for all of them)."""
        pages = self.driver.apply(Op("load", (lease,)))
        handles, parts = self.shell.handles, self.shell.part_handles
        ops = self.core.lease_ops(lease)
        return LoadResult(
            pages, [handles[op] for op in ops if op in handles], [h for op in ops for h in parts.get(op, ())]
        )

    def part_slots(self, lease: int) -> dict[str, list[tuple[int, int]]]:
        """Per component name, (page index, device slot) of what the lease holds on device: the
        SWA pages and the state its hit reads (and what it inserted). Pure."""
        names = {s.index: s.name for s in self.config.components()}
        return {names[c]: v for c, v in self.core.part_slots(lease).items()}

    # ------------------------------------------------------------------ the round

    def step(self) -> RoundReport:
        """One round: poll local completions, prepare, one all-reduce, commit."""
        start = time.perf_counter()
        report = self.driver.step()
        self.round_seconds.append(time.perf_counter() - start)  # metrics only
        if self.events is not None:
            self.events.after_round(self.core)
        return report

    def publish_events(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str = "tcp://127.0.0.1:0",
        model: str = "",
        **kw: int,
    ) -> dict[str, Any] | None:
        """On rank 0: publish what each round changes (``tpcache.events``; ``kw``: EventPublisher's
        options) and return where (endpoints, topics, the group's identity). Other ranks: None."""
        if self.rank != 0:
            return None
        import secrets

        import zmq

        from tpcache.events.publisher import EventPublisher, RoundStream

        identity = {"model": model, "namespace": self.config.namespace, "incarnation": secrets.randbits(63)}
        identity.update(tp_size=self.group.tp_size, pp_size=self.group.pp_size, page_size=self.config.page_size)
        publisher = EventPublisher(
            zmq.Context.instance(), endpoint, replay_endpoint, identity, page_size=self.config.page_size, **kw
        )
        self.events = RoundStream(publisher, self.core)
        return publisher.info()

    def drain(self, max_rounds: int = 10_000, pause_s: float = 0.0005) -> int:
        """Run rounds until no rank has anything in flight (a collective call: all ranks). Every rank
        stops in the same round: the test is the agreed ``idle`` field, not local state. With a
        broken collective no round can agree: wait for this rank's own copies instead."""
        for n in range(max_rounds):
            if self.driver.broken is not None:
                while self.shell.landed() is not None and not self.shell.drained() and n < max_rounds:
                    time.sleep(pause_s or 0.0005)
                    n += 1
                return n
            if self.step().idle:
                return n
            if pause_s:
                time.sleep(pause_s)
        raise TimeoutError(f"copies still in flight after {max_rounds} rounds")

    # ------------------------------------------------------------------ introspection

    def health(self) -> dict[str, Any]:
        return {
            "state": "closed" if self.core.closed else "open",
            "reason": self.core.closed_reason or "",
            "round": self.round.number,
            "rank": self.rank,
            "world_size": self.world_size,
            "group": self.group.name,
            "stage": self.shard.pp_rank,
            "tp_rank": self.shard.tp_rank,
            "transport": self.collective.name,
            "disabled_features": sorted(self.round.disabled),
            "broken": self.driver.broken or "",
            "storage_down": self.core.storage_down(),  # agreed: storage is off on every rank
        }

    def stats(self) -> dict[str, Any]:
        core = self.core
        out: dict[str, Any] = dict(vars(core.stats))
        device, host, staging = core.pages_in_use()
        out.update(
            rounds=self.round.number,
            seq=self.seq,
            digest=core.digest.value,
            device_pages_used=device,
            host_pages_used=host,
            host_staging_pages_used=staging,
            evictable_device_tokens=core.evictable_device_tokens,
            protected_device_tokens=core.protected_device_tokens,
            retention_cap_tokens=core.retention_cap_tokens,
            leases=core.lease_count(),
            storage_start_errors=self.shell.storage_errors,
            closed=int(core.closed),
            mismatches=dict(self.round.mismatch_counts),
        )
        return out

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        self.shell.close()
        if self.storage is not None:
            self.storage.close()
        self.collective.close()
