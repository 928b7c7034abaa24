"""``TPCacheConnector``: vLLM's KV connector API on top of tpcache.

One instance runs beside vLLM's scheduler (``SchedulerSide``: decides nothing on its own, relays
lookups, loads, saves and releases, and tells vLLM only what the workers agreed) and one in each
worker (``WorkerSide``: one tpcache rank per TP rank, one round per engine step). vLLM keeps its
device blocks; tpcache holds the host tier and the storage tier under them.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpcache.core import CacheConfig, backend
from tpcache.integrations.vllm import events as kv_events
from tpcache.integrations.vllm.compat import check_vllm
from tpcache.integrations.vllm.logs import LOGGER, speak_through_vllm
from tpcache.integrations.vllm.messages import StepOps, WorkerReport
from tpcache.integrations.vllm.options import (
    STORAGE_KEY_ENV,
    ConnectorOptions,
    agree_host_tier,
    model_identity,
    page_namespace,
    rank_facts,
    unshared_reason,
)
from tpcache.integrations.vllm.scheduler import SchedulerSide
from tpcache.integrations.vllm.stats import Increments, TPCachePromMetrics, TPCacheStats
from tpcache.integrations.vllm.worker import StepResult, WorkerSide
from tpcache.service.config import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(LOGGER)


def package_version() -> str:
    try:
        return version("tpcache")
    except PackageNotFoundError:
        return "(version unknown)"


def kv_groups(kv_cache_config: KVCacheConfig, block_size: int) -> list[tuple[list[str], bool, bool]]:
    """vLLM's KV cache groups as (layer names, sliding window?, recurrent state?), one per group, in
    group order.

    With vLLM's hybrid allocator each group has its own block table; a tpcache page holds one block
    of every group (each group is one component of the page). A full-attention group keeps every
    block for the whole request. A sliding-window group frees the blocks behind its window while
    the request runs and names its null block for them: such a page is never read after vLLM
    freed it (a save stops before it) and never written (a load skips it). A Mamba group (vLLM's
    prefix caching off: one state block per request, overwritten every step) gives a page its
    state only where a step ended at the page's boundary (``tpcache.integrations.vllm.layout``).
    Other kinds of layers are refused with the reason."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, RSWASpec, SlidingWindowSpec

    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        sliding = isinstance(spec, SlidingWindowSpec)
        full = isinstance(spec, FullAttentionSpec) and not isinstance(spec, RSWASpec)
        state = isinstance(spec, MambaSpec)
        if state:
            mode = spec.mamba_cache_mode
            if mode != "none" or spec.num_speculative_blocks:
                raise ValueError(
                    "TPCacheConnector serves Mamba layers only with vLLM's prefix caching off (enable_prefix_caching "
                    f"False: mamba_cache_mode 'none') and no speculative decoding; layers {group.layer_names[:3]} use "
                    f"mamba_cache_mode {mode!r}"
                    + (f" and {spec.num_speculative_blocks} speculative blocks" if spec.num_speculative_blocks else "")
                )
            out.append((list(group.layer_names), False, True))
            continue
        if not (sliding or full):
            raise ValueError(
                f"TPCacheConnector serves full-attention, sliding-window and Mamba layers; this model's layers "
                f"{group.layer_names[:3]} use {type(spec).__name__}"
            )
        if spec.block_size != block_size:
            raise ValueError(
                f"TPCacheConnector needs one block size for every KV cache group; layers {group.layer_names[:3]} "
                f"use {spec.block_size} tokens, block_size is {block_size}"
            )
        out.append((list(group.layer_names), sliding, False))
    if out and all(state for _, _, state in out):
        raise ValueError(
            "TPCacheConnector serves Mamba layers beside attention layers (whose block is its page); this model "
            "has Mamba layers only"
        )
    return out


class TPCacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        speak_through_vllm()
        check_vllm()  # once per process: refuses a vLLM without a hook used here, warns on an untested one
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.groups = kv_groups(kv_cache_config, self.block_size) if kv_cache_config is not None else []
        self.model_name = str(vllm_config.model_config.model)
        self.num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        # The storage tier's shard layout: the model's identity, its KV heads, and why not (if so).
        self.model_id, self.model_identity = model_identity(vllm_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self.kv_spec = groups[0].kv_cache_spec if groups else None
        self.total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.unshared_reason = unshared_reason(vllm_config, len(groups))
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.metrics: Any = None
        self._result: StepResult | None = None
        self._begun = False  # this step's operations were applied
        self._layers: dict[str, int] = {}  # attention layer name -> its index in the engine KV
        self._increments = Increments()  # vLLM's stats: what moved since the last collection
        self.events: kv_events.BlockEvents | None = None  # tpcache's tiers in vLLM's KV events (scheduler)
        self._changes: kv_events.ChangeCollector | None = None  # the rounds' changes (worker, TP rank 0)
        if role == KVConnectorRole.SCHEDULER:
            state_groups = [g for g, (_, _, m) in enumerate(self.groups) if m]
            self.scheduler = SchedulerSide(
                self.block_size,
                state_groups=state_groups,
                sync_loads=sync_loads(self.options.load_mode, self.groups),
                lookup_timeout_s=self.options.lookup_timeout_s,
            )
            if kv_events.enabled(vllm_config):
                self.events = kv_events.BlockEvents(
                    self.block_size, page_namespace(self.options.namespace, self.model_name)
                )
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A cache never fails a request: pages that did not load on every rank are computed
                # again. vLLM reads this policy right after creating the scheduler's connector.
                log.info("tpcache: kv_load_failure_policy set to 'recompute' (a missed page is recomputed)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss, never lost data

    # ================================================================== scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if self.events is not None:
            self.events.track(request)
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        if num_external_tokens > 0:
            self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self.scheduler is not None
        host, storage = self.scheduler.hit_sources(request, num_external_tokens)
        return {k: v for k, v in ((CacheHitSource.HOST, host), (CacheHitSource.DISK, storage)) if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_meta(scheduler_output)
        if self.events is not None:
            self.events.saw(meta.ops)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        report = connector_output.kv_connector_worker_meta
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        self.scheduler.update_from_output(
            report if isinstance(report, WorkerReport) else None,
            connector_output.finished_recving,
            connector_output.invalid_block_ids,
            failed,
        )
        if self.events is not None and isinstance(report, WorkerReport):
            self.events.reported(report.changes)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Every model, hybrid or not, finishes here: the last pages of every group are saved and
        vLLM keeps every group's blocks until every rank agreed its copies landed."""
        assert self.scheduler is not None
        delayed = self.scheduler.request_finished(request, block_ids)
        if self.events is not None:
            self.events.finished(request)
        return delayed, None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def has_pending_push_work(self) -> bool:
        # Keep vLLM stepping while a worker has copies or releases to agree: each step is a round.
        return self.scheduler is not None and (self.scheduler.workers_busy or bool(self.scheduler.ops))

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.events.take() if self.events is not None else ()

    def reset_cache(self) -> bool | None:
        assert self.scheduler is not None
        return self.scheduler.reset()

    # ================================================================== vLLM's stats

    def get_kv_connector_stats(self) -> TPCacheStats | None:
        """The scheduler side's counts, or (TP rank 0 only: the others agree) the worker's."""
        if self.scheduler is not None:
            totals = dict(self.scheduler.counters)
            if self.events is not None:
                totals.update({f"event_{k}": v for k, v in self.events.counters.items()})
            return self._increments.take(totals)
        if self.worker is None or self.worker.cache.rank != 0:
            return None
        return self._increments.take(self.worker.totals())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TPCacheStats | None:
        return TPCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TPCachePromMetrics:
        return TPCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        from tpcache.comm import make_collective
        from tpcache.comm.exchange import all_gather_json
        from tpcache.engine.external import EngineCache
        from tpcache.integrations.vllm.faults import FaultPlan
        from tpcache.integrations.vllm.layout import engine_kv_from_vllm
        from tpcache.io.memory import format_bytes
        from tpcache.service.config import format_kv_layout

        tp = get_tp_group()
        rank, world = tp.rank_in_group, tp.world_size
        num_blocks = self.num_blocks or int(next(iter(kv_caches.values())).shape[0])
        group_of = {name: g for g, (names, _, _) in enumerate(self.groups) for name in names} if self.groups else None
        sliding = [s for _, s, _ in self.groups]
        states = [m for _, _, m in self.groups]
        engine_kv, layout, engine_format = engine_kv_from_vllm(
            kv_caches, num_blocks, self.block_size, group_of, sliding, states
        )
        opts = self.options
        # Before anything is built: every rank's settings and machine readings, one exchange on the
        # TP group's CPU group, so that every rank builds the same cache (or none does).
        facts = rank_facts(opts, f"{format_kv_layout(layout)} {engine_format}")
        try:
            host = agree_host_tier(opts, all_gather_json(facts, group=tp.cpu_group), layout.page_bytes)
        except ConfigError as exc:
            log.error("tpcache rank %d: %s", rank, exc)
            raise
        storage, where = None, ""
        if opts.storage_dir:
            storage, where = self._open_storage(kv_caches, num_blocks, rank, world)
            secret = os.environ.get(STORAGE_KEY_ENV, "")  # checked equal on every rank by agree_host_tier
            if secret:
                from tpcache.io.storage import RecordMac

                storage.authenticate(RecordMac(secret.encode()))
        config = CacheConfig(
            page_size=self.block_size,
            device_pages=0,
            host_pages=host.pages,
            eviction_policy=opts.eviction_policy,
            namespace=page_namespace(opts.namespace, self.model_name),
            storage=storage is not None,
            mirror_release=False,
        )
        faults = FaultPlan(opts.fault_injection, rank)
        faults.kv = engine_kv
        collective = make_collective(opts.transport, group=tp.cpu_group)
        cache = EngineCache(
            config,
            collective,
            engine_kv,
            layout,
            engine_format=engine_format,
            storage=storage,
            round_timeout_s=opts.round_timeout_s,
            before_copy=faults.before_copy,
            after_copy=faults.after_copy,
            hold=faults.hold,
            layered=copies_by_layer(opts.copy_by_layer, kv_caches),
            layer_delay=faults.layer_delay,
        )
        faults.transfer = cache.transfer
        cache.transfer.check = "delay_copies" in faults.spec
        # Copies by layer: the step's operations are applied at its first hook, a save's layer starts
        # at save_kv_layer. Otherwise (none here) they are applied in wait_for_save, after the
        # forward pass has written the KV the step's saves copy.
        self._layers = {name: i for i, name in enumerate(kv_caches)} if cache.transfer.layered else {}
        self.worker = WorkerSide(
            cache, lookup_timeout_rounds=opts.lookup_timeout_rounds, reopen=opts.reopen, faults=faults
        )
        if rank == 0 and kv_events.enabled(self._vllm_config):
            self._changes = kv_events.collect_changes(cache)
        if opts.metrics_port:
            from tpcache.service.metrics import RankMetrics

            self.metrics = RankMetrics(rank)
            self.metrics.serve(opts.metrics_port + rank)
        stored = "off"
        if storage is not None:
            stored = f"{where} ({format_bytes(opts.storage_bytes)}; {storage.trust})"
        log.info(
            "tpcache %s rank %d of %d: %s; storage %s; round transport %s; tree core %s",
            package_version(),
            rank,
            world,
            host.describe(),
            stored,
            collective.name,
            backend.describe(),
        )

    def _open_storage(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int, world: int
    ) -> tuple[Any, str]:
        """This rank's storage tier and where it is, for the start-up line: the model's shard layout,
        which every TP size of the same model reads (``io.storage.sharded``), where vLLM's KV allows;
        else one file store per rank, which only this TP size reads (and a warning says why)."""
        from tpcache.comm.parallel import Shard
        from tpcache.integrations.vllm.layout import model_page_view
        from tpcache.io.errors import KVLayoutError
        from tpcache.io.storage import FileBackend
        from tpcache.io.storage.sharded import ModelShape, ShardLayoutError, open_shared_storage
        from tpcache.io.storage.url import file_url

        opts, root = self.options, Path(self.options.storage_dir)
        try:
            if self.kv_spec is None:
                raise KVLayoutError("vLLM gave no KV cache spec")
            if self.unshared_reason:
                raise KVLayoutError(self.unshared_reason)
            spec = self.kv_spec
            model_layout, view = model_page_view(
                kv_caches, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
            )
            if model_layout.heads_per_rank * world != self.total_kv_heads:
                raise KVLayoutError(
                    f"{world} TP ranks hold {model_layout.heads_per_rank} KV head(s) each of the model's "
                    f"{self.total_kv_heads}: heads are replicated"
                )
            shard = Shard(rank, world)
            model = ModelShape.of_rank(self.model_id, model_layout, shard)
            storage = open_shared_storage(
                file_url(root),
                model=model,
                shard=shard,
                layout=model_layout,
                capacity_bytes=opts.storage_bytes,
                page_view=view,
            )
            return storage, f"{root} (shared by every TP size of {self.model_identity})"
        except (KVLayoutError, ShardLayoutError) as exc:
            log.warning(
                "tpcache rank %d: storage in one directory per rank, which only TP=%d of this model reads: %s",
                rank,
                world,
                exc,
            )
        place = root / f"rank{rank}"
        return FileBackend(place, capacity_bytes=opts.storage_bytes, shard=(rank, world)), str(place)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._result = None
        self._begun = False

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Before the forward pass where the step has sync loads (after it otherwise): by layer, the
        step's operations start (already, where a layer hook came first); else its sync loads are
        copied here and the rest waits for ``wait_for_save``."""
        self._begin(sync_loads_only=not self._layers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._layers:
            return
        self._begin()
        layer = self._layers.get(layer_name)
        if layer is not None and self.worker is not None:
            self.worker.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self._layers:
            return
        self._begin()
        layer = self._layers.get(layer_name)
        if layer is not None and self.worker is not None:
            self.worker.layer_computed(layer)  # the copy of this layer's blocks starts

    def wait_for_save(self) -> None:
        self._step()

    def _begin(self, sync_loads_only: bool = False) -> None:
        """Apply this step's operations, once, at the step's first hook (``sync_loads_only``: the
        sync loads that lead them)."""
        if self._begun or self.worker is None:
            return
        self._begun = not sync_loads_only
        meta = self._connector_metadata if isinstance(self._connector_metadata, StepOps) else None
        try:
            self.worker.begin_step(meta, sync_loads_only)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take vLLM down with it
            log.exception("tpcache: applying the step's operations failed on this rank; the cache closes")
            self.worker.fail(f"engine step failed: {exc}")

    def _step(self) -> StepResult:
        """This step's round, run once (the first hook of the step after the forward calls it)."""
        if self._result is None:
            assert self.worker is not None, "register_kv_caches was not called"
            self._begin()
            try:
                self._result = self.worker.end_step()
            except Exception as exc:  # noqa: BLE001 - a bug here must not take vLLM down with it
                log.exception("tpcache: engine step failed on this rank; the cache closes")
                self.worker.fail(f"engine step failed: {exc}")
                self._result = StepResult()
            if self.metrics is not None and self.metrics.due():
                self.metrics.publish(self.worker.stats(), self.worker.cache.health(), force=True)
        return self._result

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        result = self._step()
        return result.finished_sending or None, result.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """With several KV cache groups vLLM takes no failed blocks (a block id names a block only
        within its group): a load that did not land on every rank fails its request, which vLLM
        then computes from the start."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set(self._result.failed_recving) if self.worker is not None and self._result is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None or self._result is None:
            return set()
        return set(self._result.invalid_blocks)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None or self._result is None:
            return None
        if self._changes is not None:
            self._result.report.changes = self._changes.take()
        return self._result.report

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.cache.close()
            self.worker = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


def sync_loads(mode: str, groups: list[tuple[list[str], bool]]) -> bool:
    """``load_mode``'s value for this model. vLLM recomputes a failed sync load from the invalid
    block ids a connector reports, which name a block only within one KV cache group: with several
    groups (vLLM's hybrid allocator) its scheduler refuses them and takes failed loads by request
    only from requests still waiting for an async load. So several groups load asynchronously."""
    if len(groups) == 1:
        return mode != "async"
    if mode == "sync":
        raise ConfigError(
            f'kv_connector_extra_config: load_mode "sync" needs one KV cache group, this model has {len(groups)} '
            '(vLLM cannot recompute a failed sync load there); use "auto" or "async"'
        )
    return False


def copies_by_layer(setting: bool | str, kv_caches: dict[str, torch.Tensor]) -> bool:
    """``copy_by_layer``'s value for this worker: "auto" is true where vLLM's KV is on a GPU (a side
    stream overlaps the copies with the forward pass) and false on CPU, where a copy thread only
    competes with the forward pass's own threads for the same cores."""
    if isinstance(setting, bool):
        return setting
    return any(t.is_cuda for t in kv_caches.values())


def worker_stats(worker: Any = None) -> dict[str, Any]:
    """This worker's tpcache statistics (for ``LLM.collective_rpc(worker_stats)``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    side = getattr(connector, "worker", None)
    return {} if side is None else side.stats()
