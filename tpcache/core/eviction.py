"""Eviction policies over a logical clock.

A policy maps a node to a sort key; the smallest key is evicted first. Keys use only the logical
clock (advanced by sequenced operations), counters, depth and the page hash, never wall-clock
time or object ids, so every rank orders candidates identically. Every key ends in
``(-depth, page_hash)``: within equal stamps the deepest page goes first, and ties are broken by
hash; node ids make the heap entry unique.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tpcache.core.tree import Node


class EvictionPolicy(Protocol):
    name: str

    def key(self, node: Node) -> tuple[int, ...]: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.last_access, -node.depth, node.hash)


class LFU:
    """Fewest hits first, then least recently used."""

    name = "lfu"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.hits, node.last_access, -node.depth, node.hash)


class FIFO:
    """Oldest inserted first."""

    name = "fifo"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.created_at, -node.depth, node.hash)


POLICIES: dict[str, type[LRU] | type[LFU] | type[FIFO]] = {"lru": LRU, "lfu": LFU, "fifo": FIFO}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
