"""One rank process of the service: set up the group and the cache, serve, shut down cleanly.

Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Uses
NCCL and the device ``cuda:LOCAL_RANK`` when CUDA is available, gloo on CPU otherwise. SIGINT and
SIGTERM on any rank stop every rank: a follower asks the leader, the leader fans a stop batch
out, and each rank closes its sockets, its cache (and the round transport's shared memory) and
the process group before exiting. Nothing is left in /dev/shm or on disk but the storage tier.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import zmq

from tpcache.service.channels import Channels
from tpcache.service.config import ServiceConfig, parse_kv_layout
from tpcache.service.handlers import RankHandler
from tpcache.service.metrics import RankMetrics

log = logging.getLogger("tpcache.service")


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
        from tpcache.dist.store import group_store

        backend = "nccl" if device is not None else "gloo"
        timeout = datetime.timedelta(seconds=max(60.0, 2 * round_timeout_s))
        store = group_store(timeout.total_seconds())  # loopback only on one host; per torchrun attempt
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), device


def build_cache(config: ServiceConfig, collective: Any, device: Any, pool: Any = None, storage: Any = None) -> Any:
    from tpcache.engine import TPCache

    layout = parse_kv_layout(config.kv_layout, config.page_size) if config.kv_layout else None
    return TPCache(
        config.cache_config(),
        collective,
        kv_layout=layout,
        device_pool=pool,
        device=device,
        storage=storage,
        round_timeout_s=config.round_timeout_s,
    )


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".ready-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, target)


def serve(config: ServiceConfig) -> int:
    """Run this rank until stopped; returns the exit code."""
    import torch.distributed as dist

    from tpcache.dist import make_collective
    from tpcache.service.follower import Follower
    from tpcache.service.leader import Leader

    _tag_log_records(_env_int("RANK", 0))
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s rank%(rank)s %(name)s %(levelname)s: %(message)s"
    )
    stop = StopFlag()
    stop.install()
    rank, world, device = init_group(config.round_timeout_s)
    storage = None
    if config.storage_location():
        from tpcache.io.storage import open_storage, parse_storage_url

        spec = parse_storage_url(config.storage_location())
        storage = open_storage(spec, shard=(rank, world), capacity_bytes=config.storage_bytes)
        if rank == 0:
            print(f"tpcache: storage tier: {spec.describe()}", flush=True)
    collective = make_collective(config.transport, device=device)
    tp = build_cache(config, collective, device, storage=storage)
    handler = RankHandler(tp, config, lambda pool: build_cache(config, collective, device, pool, storage))
    metrics = RankMetrics(rank)
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
            except zmq.ZMQError as exc:
                channels.broadcast({"b": 0, "s": 1, "n": 0, "e": [], "x": True})
                print(f"tpcache: cannot bind {config.endpoint}: {exc}", file=sys.stderr)
                return 2
            info = {
                "endpoint": leader.endpoint,
                "pids": channels.pids,
                "world_size": world,
                "transport": tp.collective.name,
                "metrics_ports": [config.metrics_port + r for r in range(world)] if config.metrics_port else [],
            }
            if config.ready_file:
                write_ready_file(config.ready_file, info)
            print(f"tpcache: serving on {leader.endpoint} ({world} ranks, {tp.collective.name})", flush=True)
            code = leader.run(stop)
        else:
            code = Follower(handler, channels, config, metrics).run(stop)
    finally:
        log.debug("shutting down")
        if channels is not None:
            channels.close()
        handler.close()
        metrics.close()
        ctx.term()
        log.debug("sockets and cache closed")
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down politely
            dist.destroy_process_group()
        log.debug("process group destroyed")
    return code


def _tag_log_records(rank: int) -> None:
    old = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
