"""What a node and a lease count as: their records in the state digest, and the flags the
ledger's counters and mirror index follow.

Each function here has a reference in Python; where the C extension is built, ``record_of`` and
``flags_of`` are its kernels (``_account.c``), which give the same values (``invariants.check``
recomputes records with the reference, and tests compare the two).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable

import xxhash

from tpcache.core.backend import NATIVE
from tpcache.core.digest import DIGEST_MASK, mix, mix_ids
from tpcache.core.records import Lease
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.tree import Node

_native = NATIVE

_RECORD = struct.Struct("<QqqqqqqQ")
LEASE_TAG = 0x4C45415345  # keeps lease records apart from node records in the digest
NO_IDS = mix_ids([])
_VALID = DeviceState.VALID
_NONE = DeviceState.NONE
_MIRROR = (DeviceState.VALID, HostState.VALID, StorageState.DURABLE)


def _py_unresident(nodes: dict[int, Node], ids: Iterable[int]) -> list[int]:
    """Those of ``ids`` whose node (in the tree's ``nodes``) has no copy on device or host (they
    count for nothing), in order; an id not in the tree is left out (it holds nothing)."""
    return [i for i in ids if i in nodes and not (nodes[i].device_state or nodes[i].host_state)]


unresident = _py_unresident if _native is None else _native.unresident  # the same filter in C (_account.c)


def reference_record_of(node: Node) -> int:
    """A node's contribution to the state digest: every field that decides a hit, a page number or
    an eviction (tier states, device page, host slot, pins, stamp, hits, creation time), and every
    field of its component record (``components.STRIDE`` per component)."""
    packed = _RECORD.pack(
        node.hash,
        node.device_state | node.host_state << 2 | node.storage_state << 4,
        node.device_page,
        node.host_slot,
        node.device_pins << 32 | node.host_pins,
        node.last_access,
        node.hits,
        node.created_at,
    )
    if node.comp is not None:
        packed += array("q", node.comp).tobytes()
    return xxhash.xxh3_64_intdigest(packed) & DIGEST_MASK


if _native is not None:  # the same records, in C (_account.c), component records included
    record_of = _native.record_of
else:
    record_of = reference_record_of


def lease_record(lease: Lease, prefetch_fields: list[int]) -> int:
    """A lease's contribution to the state digest: what it pins, holds and waits for (its holdings'
    totals, see ``holdings``), where ``append`` continues, and per component what it pins and holds,
    and its protected prefix."""
    cursor = 0 if lease.cursor is None else lease.cursor + 1
    record = mix(
        LEASE_TAG,
        lease.lease_id,
        lease.device_nodes.total,
        lease.host_nodes.total,
        lease.pages.total,
        mix_ids(lease.ops) if lease.ops else NO_IDS,
        int(lease.releasing) | cursor << 1,
        mix_ids(prefetch_fields) if prefetch_fields else NO_IDS,
    )
    fields: list[int] = []
    for c, held in lease.parts.items():
        if held.device_nodes or held.host_nodes or held.pages:  # an empty entry holds nothing
            fields += [c, len(held.device_nodes), *held.device_nodes]
            fields += [len(held.host_nodes), *held.host_nodes, len(held.pages), *held.pages]
    if not fields and not lease.hit_pages:
        return record
    fields.append(lease.hit_pages)
    return mix(record, mix_ids(fields))


def fold_leases(
    leases: list[Lease], value: int, kept_digest: int, records: Callable[[Lease], tuple[int, int]]
) -> tuple[int, int]:
    """``value`` and ``kept_digest`` (the state digest and the digest of what a flush keeps) with each
    lease's records replaced by ``records(lease)``'s, which are stored on the lease."""
    tag, no_ids, mix_ = LEASE_TAG, NO_IDS, mix
    for lease in leases:
        if not (lease.ops or lease.parts or lease.hit_pages) and lease.prefetch is None and lease.admission is None:
            # Most leases (no ops, components, protected hit, fetch or admission): ``records``'
            # values computed here, without its calls (``lease_record`` with no state fields).
            cursor, pages, releasing, lid = lease.cursor, lease.pages.total, lease.releasing, lease.lease_id
            at = 0 if cursor is None else cursor + 1
            record = mix_(
                tag, lid, lease.device_nodes.total, lease.host_nodes.total, pages, no_ids, releasing | at << 1, no_ids
            )
            # A running request's pages come and go (alloc, then append): its kept record often stays.
            kept = 0 if releasing else lease.kept if pages == lease.kept_of else mix_(lid, pages)
            lease.kept_of = -1 if releasing else pages
        else:
            record, kept = records(lease)
            lease.kept_of = -1  # (made of more than the pages)
        value += record - lease.record  # (masked once, after the loop: the sums are mod 2**62)
        kept_digest += kept - lease.kept
        lease.record, lease.kept = record, kept
    return value & DIGEST_MASK, kept_digest & DIGEST_MASK


def is_mirror(node: Node) -> bool:
    """On device, on host and durable in storage: the pages mirror release may free a copy of."""
    return (node.device_state, node.host_state, node.storage_state) == _MIRROR


def is_evictable(node: Node) -> bool:
    """Device-VALID with no pins: counted as evictable device tokens (the retention cap's measure)."""
    return node.device_state == _VALID and node.device_pins == 0


def is_protected(node: Node) -> bool:
    """On device (valid or loading) and pinned by a lease or an op."""
    return node.device_state != _NONE and node.device_pins > 0


EVICTABLE, PROTECTED, MIRROR = 1, 2, 4  # the bits of flags_of


def reference_flags_of(node: Node) -> int:
    """What a node counts as: ``is_evictable`` | ``is_protected`` << 1 | ``is_mirror`` << 2."""
    return is_evictable(node) | is_protected(node) << 1 | is_mirror(node) << 2


flags_of = _native.flags_of if _native is not None else reference_flags_of  # the same bits, in C


def touch_nodes(
    nodes: Iterable[Node], device_pins: int, stamp: bool, hit: bool, clock: int, value: int, offer: Callable[..., None]
) -> tuple[int, int, int, list[int]]:
    """The reference loop of ``Ledger.touch`` (``_account.c``'s ``touch`` in C): each node's pins
    moved by ``device_pins``, stamped with ``clock`` and hit as asked, re-recorded and offered.
    Returns the digest's new value (``value`` moved, unmasked), the evictable and protected deltas,
    and the ids of the nodes with no copy on device or host, in order."""
    evictable = protected = 0
    gone = []
    for node in nodes:
        if not (node.device_state or node.host_state):
            gone.append(node.node_id)
        pins = node.device_pins
        new = node.device_pins = pins + device_pins
        state = node.device_state
        if state == _VALID:
            evictable += (new == 0) - (pins == 0)
        if state != _NONE:
            protected += (new > 0) - (pins > 0)
        if stamp:
            node.last_access = clock
        if hit:
            node.hits += 1
        value -= node.record
        node.record = record_of(node)
        value += node.record
        offer(node)
    return value, evictable, protected, gone
