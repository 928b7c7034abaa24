"""Engine-owned device pages: tpcache holds the host (L2) and storage (L3) tiers under an engine's
own block pool (vLLM's), and copies between its host slots and the block ids the engine names.

The core runs with no device tier of its own (``device_pages == 0``): no node is ever on device,
and the engine's blocks never enter the tree. Two sequenced operations move KV across the border:

- ``save``: the KV of the full pages of ``tokens`` sits in the engine's ``blocks``; the pages the
  cache does not hold yet (from the first one missing on host) get fresh host slots, their nodes go
  host-WRITING, and one BACKUP op copies block -> slot. The nodes become host-VALID only when the
  round agrees the copy landed on every rank; pages past an agreed partial ack are dropped.
- ``load_into``: copy pages of the lease's hit (host-VALID pages it pins, from ``lock`` or from a
  storage prefetch) into engine blocks with one LOAD op. Nothing in the tree changes; the op's
  ``acked`` (set by the agreed completion) tells the engine how many leading pages it may use.

Both ops carry ``engine_pages=True`` (their device side is the engine's block ids) and the lease
waits for them: a lease is released only once every copy into or out of its blocks is agreed
complete, which is when the engine may reuse them (reference seed 004). The host slots a load
reads are held by the lease's own pins; the slots a save writes belong to its WRITING nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.records import OpKind, Transfer
from tpcache.core.tiers import HostState

if TYPE_CHECKING:
    from tpcache.core.cache import CacheCore
    from tpcache.core.records import Lease
    from tpcache.core.tree import Node


def require_engine_mode(core: CacheCore) -> None:
    if core.config.device_pages != 0:
        raise ValueError("engine-owned device pages need a core without a device tier (device_pages=0)")
    if core.config.host_pages <= 0:
        raise ValueError("engine-owned device pages need a host tier (host_pages > 0)")


def _check_blocks(blocks: Sequence[int], what: str = "blocks") -> list[int]:
    out = list(blocks)
    for b in out:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"{what} must be non-negative ints, found {b!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} name a block twice")
    return out


def hit_nodes(core: CacheCore, lease: Lease) -> list[Node]:
    """The leading pages of the lease's tokens that are host-VALID and pinned by the lease. Pure."""
    pinned = {n.node_id for n in lease.host_nodes}
    out: list[Node] = []
    for node in core.tree.walk(lease.tokens).nodes:
        if node.host_state != HostState.VALID or node.node_id not in pinned:
            break
        out.append(node)
    return out


def save(core: CacheCore, lease_id: int, tokens: TokenIds, blocks: Sequence[int]) -> Transfer | None:
    """Copy the full pages of ``tokens`` the cache lacks from the engine's ``blocks`` into host.

    ``blocks[i]`` holds page i. Pages from the first one not on host (valid or being written) to
    the last full page are saved, as many as host slots can be found for (evicting unpinned host
    pages, least valuable first); the rest are skipped, so the host tier stays ancestor-closed.
    Returns the op, or None when nothing needed saving or no slot was free.
    """
    core._refuse_if_closed()
    require_engine_mode(core)
    lease = core._live_lease(lease_id)
    token_bytes = as_token_bytes(tokens)
    walk = core.tree.walk(token_bytes)
    n = walk.num_pages
    blocks = _check_blocks(blocks)
    if len(blocks) < n:
        raise ValueError(f"save needs an engine block for each of {n} full pages, got {len(blocks)}")
    core._tick()
    first = 0
    while first < len(walk.nodes) and walk.nodes[first].on_host:
        first += 1
    if first == n:
        return None
    parent = walk.nodes[first - 1] if first else core.tree.root
    if first:
        core._pin_host(parent, +1)  # eviction for the new slots must not take the page they hang from
    slots = core._alloc_host_upto(n - first)
    if first:
        core._pin_host(parent, -1)
    if not slots:
        return None
    walk = core.tree.walk(token_bytes)  # eviction may have removed nodes past `first`
    nodes: list[Node] = []
    for i, slot in zip(range(first, first + len(slots)), slots, strict=True):
        node = walk.nodes[i] if i < len(walk.nodes) else None
        if node is None:
            node = core.tree.add_child(parent, walk.pages[i], walk.hashes[i], core.clock)
        else:
            core._unaccount(node)
        core._set_host(node, HostState.WRITING, slot)
        node.last_access = core.clock
        core._account(node)
        nodes.append(node)
        parent = node
    op = _issue(core, lease, OpKind.BACKUP, nodes, blocks[first : first + len(slots)])
    core.stats.backups_issued_pages += len(nodes)
    return op


def load_into(core: CacheCore, lease_id: int, first_page: int, blocks: Sequence[int]) -> Transfer | None:
    """Copy pages ``first_page ..`` of the lease's hit into the engine's ``blocks`` (one per page).

    The pages must be part of the hit (``hit_pages``); their host slots stay pinned by the lease
    until it is released, which waits for this op. Returns the op (None for no blocks); its
    ``acked`` is the agreed count of leading pages that landed on every rank.
    """
    core._refuse_if_closed()
    require_engine_mode(core)
    lease = core._live_lease(lease_id)
    blocks = _check_blocks(blocks)
    if isinstance(first_page, bool) or not isinstance(first_page, int) or first_page < 0:
        raise ValueError(f"first_page must be a non-negative int, got {first_page!r}")
    held = hit_nodes(core, lease)
    if first_page + len(blocks) > len(held):
        raise ValueError(
            f"lease {lease_id} holds {len(held)} pages; cannot load pages {first_page}..{first_page + len(blocks) - 1}"
        )
    if not blocks:
        return None
    core._tick()
    op = _issue(core, lease, OpKind.LOAD, held[first_page : first_page + len(blocks)], blocks)
    core.stats.loads_issued_pages += len(blocks)
    return op


def _issue(core: CacheCore, lease: Lease, kind: OpKind, nodes: list[Node], blocks: list[int]) -> Transfer:
    op = core._issue(kind, nodes, lease.lease_id)
    op.engine_pages = True
    op.device_pages = blocks
    core._unaccount_lease(lease)
    core._lease_waits_for(lease, op.op_id)
    core._account_lease(lease)
    return op
