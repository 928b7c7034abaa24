"""What travels on the event stream, and the one definition of its digest.

Three kinds of message, each a ZMQ multipart message ``(topic, sequence, payload)`` as vLLM's
``ZmqEventPublisher`` sends them, the sequence an unsigned 64-bit big-endian integer:

- on the events topic, one batch per round that changed something: vLLM's ``KVEventBatch`` in its
  msgpack form (``[ts, [event, ...]]``, each event a map tagged ``"type"``: ``AllBlocksCleared``,
  then ``BlockRemoved`` per tier, then ``BlockStored`` per tier), the tier as vLLM's ``medium``
  (``GPU`` device, ``CPU`` host, ``STORAGE`` storage). Sequence numbers count batches from 0 in each
  incarnation, without gaps; batch 0 is ``[AllBlocksCleared]`` (the cache starts empty);
- on the digest topic, every ``events_digest_every`` batches and after batch 0: a map
  ``{"seq", "digest", "pages", "group"}``: the digest of the set of (page hash, tier) the batches up
  to ``seq`` leave, its size, and the group's identity;
- on the replay endpoint (ROUTER), answers to a DEALER's requests (``replay``, ``snapshot``,
  ``hello`` below).

The digest of a set of (page hash, tier) pairs is the sum, modulo 2**64, of
``xxh3_64(le64(page_hash) || u8(tier))`` over the pairs (tier 0 device, 1 host, 2 storage): it
does not depend on the order the pairs were added in, and a mirror keeps it by adding a pair's
term when the pair enters and subtracting it when the pair leaves.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import xxhash

from tpcache.core import backend

MEDIUMS = ("GPU", "CPU", "STORAGE")  # vLLM's medium values, by tier (device, host, storage)
TIER_OF_MEDIUM = {m: t for t, m in enumerate(MEDIUMS)}
TIERS = ("device", "host", "storage")
MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
HELLO, SNAPSHOT, SNAPSHOT_END, REFUSED = b"hello", b"snapshot", b"snapshot-end", b"refused"
DIGEST_TOPIC = "tpcache-digest"

PAIR = struct.Struct("<QB")
xxh3_64 = xxhash.xxh3_64_intdigest


def pair_term(page_hash: int, tier: int) -> int:
    """One (page hash, tier) pair's term in the digest."""
    return xxh3_64(PAIR.pack(page_hash, tier))


def reference_pair_sum(hashes: list[int], tier: int) -> int:
    """The sum, modulo 2**64, of the terms of ``hashes`` on ``tier``."""
    return sum(pair_term(h, tier) for h in hashes) & MASK


# the same value in C (core/_round.c) under the native tree core
pair_sum = backend.NATIVE.pair_sum if backend.NATIVE is not None else reference_pair_sum


def digest_of(tiers: tuple[set[int], set[int], set[int]] | list[list[int]]) -> int:
    """The digest of per-tier collections of page hashes (see the module docstring)."""
    return sum(pair_sum(hashes, tier) for tier, hashes in enumerate(tiers)) & MASK


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def stored_event(hashes: list[int], tier: int, page_size: int) -> dict[str, Any]:
    """vLLM's ``BlockStored``: tpcache's page hashes (which chain their parents already, so no
    ``parent_block_hash``), no token ids."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": page_size,
        "lora_id": None,
        "medium": MEDIUMS[tier],
        "lora_name": None,
    }


def removed_event(hashes: list[int], tier: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUMS[tier]}


CLEARED = {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """vLLM's ``KVEventBatch`` (array-like: ``[ts, events]``; ``data_parallel_rank`` left out)."""
    return msgpack.packb([ts, events], use_bin_type=True)


class BatchEncoder:
    """``encode_batch`` of the events above, the same bytes, built from pre-packed pieces: one
    msgpack call per list of page hashes, no event dict (the publisher's round thread)."""

    def __init__(self, page_size: int) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)
        self.cleared = pack(CLEARED)
        self._stored = []  # per tier: (the packed map up to its hashes, what follows them)
        self._removed = []
        for tier in range(len(MEDIUMS)):
            self._stored.append(_split(stored_event([], tier, page_size)))
            self._removed.append(_split(removed_event([], tier)))

    def stored(self, hashes: list[int], tier: int) -> bytes:
        head, tail = self._stored[tier]
        return head + self._packer.pack(hashes) + tail

    def removed(self, hashes: list[int], tier: int) -> bytes:
        head, tail = self._removed[tier]
        return head + self._packer.pack(hashes) + tail

    def batch(self, ts: float, events: list[bytes]) -> bytes:
        """The batch of events made by ``stored``, ``removed`` and ``cleared``, in order."""
        packer = self._packer
        return b"".join((packer.pack_array_header(2), packer.pack(ts), packer.pack_array_header(len(events)), *events))


def _split(event: dict[str, Any]) -> tuple[bytes, bytes]:
    """An event with no hashes, packed, cut where its (empty) ``block_hashes`` array goes."""
    packed = pack(event)
    key = pack("block_hashes")
    at = packed.index(key) + len(key)
    assert packed[at] == 0x90  # the empty array
    return packed[:at], packed[at + 1 :]


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of a batch (what ``encode_batch`` made, or vLLM's own publisher)."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    return batch[1]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
