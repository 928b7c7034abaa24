"""Rank 0's event stream in the service: the settings turned into a publisher of the core's change
feed, which the leader runs after each round's commit (``after_round``)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

import zmq

from tpcache.events.publisher import EventPublisher, RoundStream
from tpcache.service.config import ServiceConfig, events_endpoints

log = logging.getLogger("tpcache.service")


class EventStream(RoundStream):
    def __init__(self, config: ServiceConfig, ctx: zmq.Context, core: Any, world_size: int) -> None:
        endpoint, replay = events_endpoints(config)
        group = config.group(world_size)
        identity = {
            "model": config.events_model,
            "namespace": config.namespace,
            # Drawn by rank 0 at each start; it names the stream, never anything in the cache.
            "incarnation": secrets.randbits(63),
            "tp_size": group.tp_size,
            "pp_size": group.pp_size,
            "page_size": config.page_size,
        }
        publisher = EventPublisher(
            ctx,
            endpoint,
            replay,
            identity,
            page_size=config.page_size,
            topic=config.events_topic,
            replay_batches=config.events_replay_batches,
            replay_bytes=config.events_replay_mib << 20,
            digest_every=config.events_digest_every,
            snapshot_max_pages=config.events_snapshot_max_pages,
            batch_s=config.events_batch_ms / 1000,
        )
        super().__init__(publisher, core)
        info = publisher.info()
        log.info(
            "KV events: topic %s on %s, replay and snapshots on %s, incarnation %d",
            info["topic"],
            info["endpoint"],
            info["replay_endpoint"],
            identity["incarnation"],
        )

    def info(self) -> dict[str, Any]:
        return self.publisher.info()

    def counters(self) -> dict[str, int]:
        return self.publisher.counters
