"""Rank 0's event stream in the service: the settings turned into a publisher, and what the leader
calls after each round's commit (``after_round``)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

import zmq

from tpcache.core.feed import ChangeFeed, Changes, on_tiers
from tpcache.events.publisher import EventPublisher
from tpcache.service.config import ServiceConfig, events_endpoints

log = logging.getLogger("tpcache.service")


class EventStream:
    """The change feed of rank 0's core, published after every round."""

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
        self.feed = ChangeFeed()
        self.closed = False  # the last batch told subscribers the cache is closed (all cleared)
        core.ledger.feed = self.feed
        self.publisher = EventPublisher(
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
        )
        info = self.publisher.info()
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

    def after_round(self, core: Any) -> None:
        """Publish what changed since the last round. A closed cache serves no hit: it is published
        as all cleared, and once it reopens (an agreed flush) as cleared plus what it then holds."""
        feed = self.feed
        if core.ledger.feed is not feed:  # the core was rebuilt: start its stream over from what it holds
            core.ledger.feed = feed
            feed.drain()
            self.publisher.publish(_everything(core))
            return
        changes = feed.drain()
        if core.closed:
            if not self.closed:
                self.closed = True
                self.publisher.publish(Changes(cleared=True), force=True)
            return
        if self.closed:
            self.closed = False
            if not changes.cleared:
                changes = _everything(core)
        self.publisher.publish(changes)

    def close(self) -> None:
        self.publisher.close()


def _everything(core: Any) -> Changes:
    tiers = on_tiers(core.tree.nodes.values())
    out = Changes(cleared=True)
    for tier, hashes in enumerate(tiers):
        out.stored[tier].extend(sorted(hashes))
    return out
