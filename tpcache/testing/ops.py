"""Random client operations against a CacheCore, as plain tuples (printable, replayable).

``apply(core, op, leases)`` applies one op the way a client would; refusals a real client would
get (out of pages, closed cache, lease already gone) are part of the behaviour, not errors.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpcache.core import CacheClosed, CacheCore, NoCursor, OutOfPages, UnknownLease
from tpcache.core.hitrule import keeps_state

if TYPE_CHECKING:
    from tpcache.engine import TPCache

Op = tuple


def take_transfers(core: CacheCore) -> list:
    """Act on the core's Ready the way a driver that starts nothing would: return its new ops."""
    ready = core.ready()
    core.advance()
    return ready.transfers


def tokens_for(pages: tuple[int, ...], page_size: int, tail: int) -> list[int]:
    out = []
    for depth, v in enumerate(pages):
        out += [v * 1000 + depth * 10 + i for i in range(page_size)]
    return out + [7] * tail


def random_op(
    rng: random.Random,
    page_size: int,
    alphabet: int = 4,
    max_pages: int = 6,
    requests: float = 0.0,
    appends: float = 0.0,
) -> Op:
    """One random client op. ``requests``: the share of whole requests (lock, load, compute, insert,
    release in one go, as an engine runs them), which keep leases short and the tiers moving.
    ``appends``: the share of running requests growing by a page or two (``append``)."""
    if appends and rng.random() < appends:
        return ("append", rng.randrange(8), tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, 2))))
    if requests and rng.random() < requests:
        if rng.random() < 0.15:  # pages leave both tiers; storage may still hold them
            return ("evict", rng.randint(2, 6))
        n = rng.randint(1, max_pages)
        fetch = rng.random() < 0.25  # look the rest up in storage and leave the lease open
        return ("request", tuple(rng.randrange(alphabet) for _ in range(n)), rng.randrange(page_size), fetch)
    r = rng.random()
    if r < 0.35:
        n = rng.randint(1, max_pages)
        return ("lock", tuple(rng.randrange(alphabet) for _ in range(n)), rng.randrange(page_size))
    if r < 0.60:
        return ("insert", rng.randrange(8))
    if r < 0.64:
        return ("load", rng.randrange(8))
    if r < 0.68:  # a request with host hits: load them, then insert before the loads are agreed
        return ("load_insert", rng.randrange(8))
    if r < 0.74:
        return ("prefetch", rng.randrange(8))
    if r < 0.90:
        return ("release", rng.randrange(8))
    if r < 0.925:  # pages leave the device and stay on host: the next requests load them back
        return ("demote", rng.randint(1, 4))
    if r < 0.95:
        return ("evict", rng.randint(1, 4))
    return ("cap", rng.choice([-1, 0, page_size, 4 * page_size]))


def part_slots(
    target: CacheCore | TPCache,
    lease_id: int,
    first: int,
    hashes: list[int],
    write_part: Callable[[int, int, int], None] | None = None,
) -> dict[int, list[int]]:
    """The component slots an engine fills for pages ``first..`` of a request (every SWA page; a
    state where the configuration keeps one), as ``insert`` takes them: per component, a slot per
    page (-1: none). ``write_part(component, slot, page_hash)`` plays the forward pass."""
    core = target if isinstance(target, CacheCore) else target.core
    n = len(hashes)
    out: dict[int, list[int]] = {}
    for c, part in core.ledger.parts.items():
        every = part.spec.every
        at = [i for i in range(first, n) if not every or keeps_state(every, i, n - 1)]
        slots = target.alloc(lease_id, len(at), c) if at else []
        row = [-1] * n
        for i, slot in zip(at, slots, strict=True):
            row[i] = slot
            if write_part is not None:
                write_part(c, slot, hashes[i])
        out[c] = row
    return out


def _compute_and_insert(
    target: CacheCore | TPCache,
    core: CacheCore,
    lease_id: int,
    tokens: list[int],
    write_kv: Callable[[int, int], None] | None,
    write_part: Callable[[int, int, int], None] | None,
) -> None:
    """The engine's part of a request: compute what the device hit lacks, then insert it all."""
    match = target.match(tokens)
    held = set(core.lease(lease_id).device_nodes)
    prefix = []
    ids = match.nodes[: match.device_pages]
    for node_id, page in zip(ids, core.treecore.device_pages(ids), strict=True):
        if node_id not in held:
            break  # only pages this lease pins are safe from the allocation below
        prefix.append(page)
    fresh = target.alloc(lease_id, match.num_pages - len(prefix))
    if write_kv is not None:
        for page, page_hash in zip(fresh, match.page_hashes[len(prefix) :], strict=True):
            write_kv(page, page_hash)
    if core.ledger.parts:
        parts = part_slots(target, lease_id, len(prefix), match.page_hashes, write_part)
        target.insert(lease_id, tokens, prefix + fresh, parts)
    else:
        target.insert(lease_id, tokens, prefix + fresh)


def _append(
    target: CacheCore | TPCache,
    core: CacheCore,
    lease_id: int,
    tokens: list[int],
    more: tuple[int, ...],
    write_kv: Callable[[int, int], None] | None,
    write_part: Callable[[int, int, int], None] | None,
) -> list[int]:
    """A running request's next pages: compute them, then ``append`` them alone. Returns the
    request's tokens after them (its partial last page, if any, is dropped: decode filled it)."""
    ps = core.page_size
    full = tokens[: len(tokens) // ps * ps]
    new = tokens_for(more, ps, 0)
    new = [t + len(full) // ps * 10 for t in new]  # the pages' depths, as tokens_for numbers them
    hashes = core.match(full + new).page_hashes[len(full) // ps :]
    fresh = target.alloc(lease_id, len(more))
    if write_kv is not None:
        for page, page_hash in zip(fresh, hashes, strict=True):
            write_kv(page, page_hash)
    parts = None
    if core.ledger.parts:
        rows = part_slots(target, lease_id, 0, hashes, write_part)
        parts = {c: row for c, row in rows.items()}
    target.append(lease_id, new, fresh, parts)
    return full + new


def evict(core: CacheCore, n: int, host: bool = True) -> None:
    """Forget up to ``n`` pages on device (and on host), and as much of each component's data."""
    core.evict_device(n)
    for part in core.ledger.parts.values():
        core.part_evictor.evict_device(part, n)
    if host:
        core.evict_host(n)
        for part in core.ledger.parts.values():
            core.part_evictor.evict_host(part, n)


def apply(
    target: CacheCore | TPCache,
    op: Op,
    leases: list[tuple[int, list[int]]],
    write_kv: Callable[[int, int], None] | None = None,
    write_part: Callable[[int, int, int], None] | None = None,
) -> None:
    """Apply ``op`` to a CacheCore or a TPCache (same operation names); ``leases`` holds the open
    (lease id, tokens) pairs in opening order. ``write_kv(page, page_hash)`` plays the engine's
    forward pass: it fills each freshly allocated page before insert (``write_part`` each
    component slot, for a hybrid model)."""
    core = target if isinstance(target, CacheCore) else target.core
    kind = op[0]
    try:
        if kind == "lock":
            tokens = tokens_for(op[1], core.page_size, op[2])
            lease_id, _ = target.lock(tokens)
            leases.append((lease_id, tokens))
        elif kind == "append" and leases:
            at = op[1] % len(leases)
            lease_id, tokens = leases[at]
            leases[at] = (lease_id, _append(target, core, lease_id, tokens, op[2], write_kv, write_part))
        elif kind in ("insert", "load", "load_insert", "release", "prefetch") and leases:
            lease_id, tokens = leases[op[1] % len(leases)]
            if kind == "load_insert":
                target.load(lease_id)
            if kind in ("insert", "load_insert"):
                _compute_and_insert(target, core, lease_id, tokens, write_kv, write_part)
            elif kind == "load":
                target.load(lease_id)
            elif kind == "prefetch":
                target.prefetch(lease_id)
            else:
                target.release(lease_id)
                leases.remove((lease_id, tokens))
        elif kind == "request":
            tokens = tokens_for(op[1], core.page_size, op[2])
            lease_id, match = target.lock(tokens)
            if op[3]:  # the prefetch lands in later rounds; a later insert or load_insert finishes it
                leases.append((lease_id, tokens))
                target.prefetch(lease_id)
                return
            try:
                if match.host_pages:
                    target.load(lease_id)  # parked by the release below until the load is agreed
                _compute_and_insert(target, core, lease_id, tokens, write_kv, write_part)
            finally:
                target.release(lease_id)
        elif kind in ("evict", "demote") and target is core:  # not a sequenced engine operation
            evict(core, op[1], host=kind == "evict")
        elif kind == "cap":
            target.set_retention_cap(op[1])
    except (OutOfPages, CacheClosed, UnknownLease, NoCursor):
        pass
