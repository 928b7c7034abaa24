"""One rank process of the service: check, set up the group and the cache, serve, shut down cleanly.

Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Uses NCCL and the device ``cuda:LOCAL_RANK`` when CUDA is available, gloo on CPU
otherwise.

Start-up, in order: this rank's machine checks (ports, storage directory, a shared store's
servers, memory for its pools; they create nothing); the group forms; every rank's settings and
check results are gathered (``agree``) and any problem, or any setting that must be equal and is
not, stops every rank with exit code 2 before a pool is allocated; then each rank opens its storage
tier (creating the file tier's directory, joining a shared store), and one that cannot stops every
rank alike; then the cache, the channels, and one INFO block that says what runs. A group that
does not start prints one line (rank 0), with the traceback, if any, at DEBUG.

SIGINT and SIGTERM on any rank stop every rank: a follower asks the leader, the leader answers
what is in flight with "the service is stopping", fans a stop batch out, and each rank closes its
sockets, its cache (and the round transport's shared memory) and the process group before
exiting 0. Nothing is left in /dev/shm or on disk but the storage tier.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import zmq

from tpcache.core import backend
from tpcache.service.channels import Channels
from tpcache.service.config import (
    DEFAULT,
    TRACE_OPS_ENV,
    ConfigError,
    Resolved,
    ServiceConfig,
    describe_sources,
    format_bytes,
    format_kv_layout,
    spelling,
)
from tpcache.service.handlers import RankHandler
from tpcache.service.metrics import RankMetrics
from tpcache.service.preflight import PoolBytes, check_device_memory, preflight

log = logging.getLogger("tpcache.service")

EXIT_CONFIG = 2


class StopFlag:
    """Set by SIGINT/SIGTERM; the loops poll it between batches."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            if self.signal is None:
                log.info("signal %d: stopping", signum)
            self.signal = signum

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def _freeze_startup_objects() -> None:
    """Move everything start-up made (torch, the modules, the pools' bookkeeping) out of the
    collector's reach: full collections while serving then walk only what serving made, not the
    hundreds of thousands of objects torch's import leaves, which never become garbage."""
    gc.collect()
    gc.freeze()


def package_version() -> str:
    try:
        return version("tpcache")
    except PackageNotFoundError:
        return "unknown"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def init_group(round_timeout_s: float) -> tuple[int, int, Any]:
    """Join (or reuse) the default process group; returns (rank, world_size, device)."""
    import torch
    import torch.distributed as dist

    local_rank = _env_int("LOCAL_RANK", 0)
    device: Any = None
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        from tpcache.comm.store import group_store

        backend = "nccl" if device is not None else "gloo"
        timeout = datetime.timedelta(seconds=max(60.0, 2 * round_timeout_s))
        store = group_store(timeout.total_seconds())  # loopback only on one host; per torchrun attempt
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), device


def agree(config: ServiceConfig, problem: str | None) -> str | None:
    """Gather every rank's settings and check result (a collective call, right after the group
    forms); the first problem anywhere, or the settings that differ with each rank's value, as
    one line, or None when the group may start. Every rank computes the same answer."""
    from tpcache.comm.exchange import all_gather_json

    gathered = all_gather_json({"settings": config.group_settings(), "problem": problem})
    for rank, item in enumerate(gathered):
        if item["problem"]:
            return f"rank {rank}: {item['problem']}" if len(gathered) > 1 else str(item["problem"])
    differ = []
    for name in gathered[0]["settings"]:
        values = [item["settings"].get(name) for item in gathered]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r} {json.dumps(v)}" for r, v in enumerate(values))
            differ.append(f"{name} ({per_rank})")
    if differ:
        return "settings that must be equal on every rank differ: " + "; ".join(differ)
    return None


def build_cache(config: ServiceConfig, collective: Any, device: Any, pool: Any = None, storage: Any = None) -> Any:
    """This rank's cache; with ``TPCACHE_TRACE_OPS`` set, its driver appends every op it applies to
    ``rank<r>.ops`` in that folder (``tpcache.engine.sequenced.read_ops`` reads it)."""
    from tpcache.engine import TPCache
    from tpcache.engine.sequenced import OpLog

    world = collective.world_size
    tp = TPCache(
        config.cache_config(),
        collective,
        group=config.group(world),
        kv_layout=config.rank_layout(world),
        device_pool=pool,
        device=device,
        storage=storage,
        round_timeout_s=config.round_timeout_s,
    )
    trace = os.environ.get(TRACE_OPS_ENV)
    if trace:
        tp.driver.trace = OpLog(Path(trace) / f"rank{collective.rank}.ops")
    return tp


def open_model_storage(config: ServiceConfig, shard: Any, world: int) -> Any:
    """The shared storage layout for this rank (``--model-id`` with ``--model-layout``)."""
    from tpcache.io.storage.sharded import ModelShape, open_shared_storage

    layout = config.rank_layout(world)  # a shape that splits the model's shards is refused there
    model = ModelShape.of_rank(config.model_id, layout, shard)
    return open_shared_storage(
        config.storage_location(),
        model=model,
        shard=shard,
        layout=layout,
        capacity_bytes=config.storage_bytes,
        storage_key=config.storage_secret(),
    )


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, target)


def setup_logging(level: str, rank: int) -> None:
    """Logs to stderr (stdout stays free for what a command prints, e.g. --json)."""
    _tag_log_records(rank)
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s rank%(rank)s %(name)s %(levelname)s: %(message)s",
    )


def serve(resolved: Resolved) -> int:
    """Run this rank until stopped; returns the exit code."""
    from prometheus_client import disable_created_metrics

    config = resolved.config
    env_rank = _env_int("RANK", 0)
    setup_logging(config.log_level, env_rank)
    disable_created_metrics()  # no *_created family beside each counter and histogram in /metrics
    stop = StopFlag()
    stop.install()
    world_env = _env_int("WORLD_SIZE", 1)
    on_host = _env_int("LOCAL_WORLD_SIZE", world_env)
    problem: str | None = None
    import torch

    cuda = torch.cuda.is_available()
    try:
        preflight(resolved, range(env_rank, env_rank + 1), on_host, device_on_host=not cuda, world=world_env)
    except ConfigError as exc:
        problem = str(exc)
    try:
        backend.require(config.tree_core)  # the launcher set TPCACHE_TREE_CORE before this process imported tpcache
    except backend.TreeCoreError as exc:
        problem = problem or str(exc)
    rank, world, device = init_group(config.round_timeout_s)
    if device is not None and problem is None:
        try:
            check_device_memory(resolved, torch.cuda.mem_get_info(device)[0], world)
        except ConfigError as exc:
            problem = str(exc)
    problem = agree(config, problem)
    if problem is not None:
        return refuse(rank, "configuration error", problem)
    # Every rank passed its checks: only now is anything created (the file tier's directories) or
    # joined (a shared store). A store that cannot be opened on any rank stops the group alike.
    storage, problem = open_rank_storage(resolved, rank, world)
    problem = agree(config, problem)
    if problem is not None:
        if storage is not None:
            with contextlib.suppress(Exception):
                storage.close()
        return refuse(rank, "cannot start", problem)
    return _run(resolved, rank, world, device, stop, storage)


def open_rank_storage(resolved: Resolved, rank: int, world: int) -> tuple[Any, str | None]:
    """This rank's storage tier (None when off) and, if it cannot be opened, why, as one line that
    names the setting (the traceback goes to the DEBUG log)."""
    config = resolved.config
    location = config.storage_location()
    if not location:
        return None, None
    from tpcache.io.storage import open_storage, parse_storage_url

    try:
        spec = parse_storage_url(location)
        shard = config.group(world).place(rank)
        if config.model_id:
            return open_model_storage(config, shard, world), None
        storage = open_storage(
            spec, shard=shard, capacity_bytes=config.storage_bytes, storage_key=config.storage_secret()
        )
        return storage, None
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the group stops with one line
        log.debug("opening the storage tier failed", exc_info=True)
        name = "storage_dir" if config.storage_dir else "storage_url"
        where = spelling(name, getattr(config, name), resolved.sources.get(name, DEFAULT))
        return None, f"{where}: cannot open the storage tier: {one_line(exc)}"


def one_line(exc: BaseException) -> str:
    """An exception as one line of text (its type when it has no message)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def refuse(rank: int, kind: str, problem: str) -> int:
    """Stop this rank of a group that may not start. Rank 0 prints the one line (and, under
    torchrun, writes it to the error file torchrun's summary shows); the exit code is 2, except
    for the other ranks under torchrun, which exit 0 so that its summary names one failure."""
    import torch.distributed as dist

    line = f"tpcache: {kind}: {problem}"
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        _write_torchrun_error(line)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0 if rank != 0 and os.environ.get(TORCHRUN_ENV) else EXIT_CONFIG


TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun for each worker
TORCHRUN_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _write_torchrun_error(line: str) -> None:
    """torchrun prints a failed worker's error file in its summary (else "To enable traceback see
    ..."): the one line goes there, in the form torch's ``record`` writes."""
    path = os.environ.get(TORCHRUN_ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data))


def _run(resolved: Resolved, rank: int, world: int, device: Any, stop: StopFlag, storage: Any) -> int:
    import torch.distributed as dist

    from tpcache.comm import make_collective
    from tpcache.service.follower import Follower
    from tpcache.service.leader import BindError, Leader

    config = resolved.config
    if storage is not None and rank == 0:
        from tpcache.io.storage import parse_storage_url

        log.info("storage tier: %s; %s", parse_storage_url(config.storage_location()).describe(), storage.trust)
        if config.model_id:
            log.info("storage layout: shared by every group shape of %s", storage.model.describe())
    collective = make_collective(config.transport, device=device)
    tp = build_cache(config, collective, device, storage=storage)
    handler = RankHandler(tp, config, lambda pool: build_cache(config, collective, device, pool, storage))
    buffer = config.host_mode == "buffer"  # host slots are staging then, not a cached tier
    capacity = {"device": config.device_pages, "host": 0 if buffer else config.host_pages}
    capacity["staging"] = config.host_pages if buffer else 0
    metrics = RankMetrics(
        rank, storage=storage, capacity=capacity, version=package_version(), events=bool(config.events_endpoint)
    )
    ctx = zmq.Context()
    channels: Channels | None = None
    code = 0
    try:
        if config.metrics_port:
            metrics.serve(config.metrics_port + rank)
        channels = Channels.open(ctx, rank, world, config.internal_host)
        metrics.publish(handler.stats_values(), tp.health(), force=True)
        if rank == 0:
            try:
                leader = Leader(handler, channels, config, metrics, ctx)
            except BindError as exc:
                channels.broadcast({"b": 0, "s": 1, "n": 0, "e": [], "x": True})
                where = spelling(exc.name, getattr(config, exc.name), resolved.sources.get(exc.name, DEFAULT))
                print(f"tpcache: cannot bind {where}: {exc}", file=sys.stderr)
                return EXIT_CONFIG
            log.info("%s", startup_block(resolved, tp, rank, world, channels, leader.endpoint, storage))
            info = {
                "endpoint": leader.endpoint,
                "pids": channels.pids,
                "world_size": world,
                "transport": tp.collective.name,
                "metrics_ports": [config.metrics_port + r for r in range(world)] if config.metrics_port else [],
                "events": leader.events.info() if leader.events is not None else None,
            }
            if config.ready_file:
                write_ready_file(config.ready_file, info)
            metrics.phase = "serving"
            _freeze_startup_objects()
            code = leader.run(stop)
        else:
            log.info("%s", startup_block(resolved, tp, rank, world, channels, None, storage))
            metrics.phase = "serving"
            _freeze_startup_objects()
            code = Follower(handler, channels, config, metrics).run(stop)
    finally:
        metrics.phase = "stopping"
        log.debug("shutting down")
        if channels is not None:
            channels.close()
        handler.close()
        metrics.close()
        ctx.term()
        log.debug("sockets and cache closed")
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down politely
            dist.destroy_process_group()
        log.info("stopped")
    return code


def startup_block(
    resolved: Resolved, tp: Any, rank: int, world: int, channels: Channels, endpoint: str | None, storage: Any
) -> str:
    """What this rank runs, in one log record: version, settings and their sources, memory per
    tier, transport, endpoints, storage, metrics."""
    config = resolved.config
    pools = PoolBytes.of(config, world)
    where = (
        "GPU " + str(tp.device_pool.kv.device) if tp.device_pool is not None and tp.device_pool.kv.is_cuda else "host"
    )
    if tp.kv_layout is None:
        memory = (
            f"device tier {config.device_pages:,} pages, host tier {config.host_pages:,} pages of {config.page_size} "
            "tokens (metadata only: no KV bytes, copies complete at once)"
        )
    else:
        memory = (
            f"{format_kv_layout(tp.kv_layout)}, {format_bytes(pools.page_bytes)} a page: device tier "
            f"{config.device_pages:,} pages = {format_bytes(pools.device)} ({where} memory), host tier "
            f"{config.host_pages:,} pages = {format_bytes(pools.host)}"
        )
    if storage is not None:
        stats = storage.stats()
        from tpcache.io.storage.url import parse_storage_url

        spec = parse_storage_url(config.storage_location())
        if spec.backend == "file":
            capacity = format_bytes(int(stats.get("capacity_bytes", config.storage_bytes)))  # as the disk allows
            place = f"{Path(spec.location) / f'rank{rank}'} (file backend), capacity {capacity}"
        else:
            place = f"{spec.describe()} (sized by the store)"
        store = f"{place}, {format_bytes(int(stats.get('bytes_used', 0)))} in use; {storage.trust}"
    else:
        store = "off"
    metrics = (
        f"http://127.0.0.1:{config.metrics_port + rank}/metrics (/health, /ready)" if config.metrics_port else "off"
    )
    inbox = channels.inbox.getsockopt(zmq.LAST_ENDPOINT).decode() if channels.inbox is not None else "-"
    front = f"clients {endpoint}; " if endpoint else ""
    lines = [
        f"tpcache {package_version()}: rank {rank} of {world} serving (pid {os.getpid()})",
        *(f"  settings {line}" for line in describe_sources(resolved)),
        f"  tree core: {tree_core(resolved)}",
        f"  group: {holds(tp)}",
        f"  memory: {memory}",
        f"  round transport: {tp.collective.name}; {front}internal channel {inbox}",
        f"  storage: {store}",
        f"  metrics: {metrics}",
    ]
    return "\n".join(lines)


def tree_core(resolved: Resolved) -> str:
    """The tree core this rank runs, and why: the setting's source, or why the default is what it is."""
    source = resolved.sources.get("tree_core", DEFAULT)
    return f"{backend.NAME} ({backend.DEFAULT_WHY if source == DEFAULT else 'set by ' + source})"


def holds(tp: Any) -> str:
    """What this rank holds of each page, in words (its stage's layers, its tensor rank's heads)."""
    layout = tp.kv_layout
    per = (layout.num_layers, layout.heads_per_rank) if layout is not None else (None, None)
    return tp.group.describe(tp.rank, *per)


def _tag_log_records(rank: int) -> None:
    old = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
