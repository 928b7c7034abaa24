"""Random client operations against a CacheCore, as plain tuples (printable, replayable).

``apply(core, op, leases)`` applies one op the way a client would; refusals a real client would
get (out of pages, closed cache, lease already gone) are part of the behaviour, not errors.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpcache.core import CacheClosed, CacheCore, OutOfPages, UnknownLease

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


def random_op(rng: random.Random, page_size: int, alphabet: int = 4, max_pages: int = 6) -> Op:
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
    if r < 0.95:
        return ("evict", rng.randint(1, 4))
    return ("cap", rng.choice([-1, 0, page_size, 4 * page_size]))


def apply(
    target: CacheCore | TPCache,
    op: Op,
    leases: list[tuple[int, list[int]]],
    write_kv: Callable[[int, int], None] | None = None,
) -> None:
    """Apply ``op`` to a CacheCore or a TPCache (same operation names); ``leases`` holds the open
    (lease id, tokens) pairs in opening order. ``write_kv(page, page_hash)`` plays the engine's
    forward pass: it fills each freshly allocated page before insert."""
    core = target if isinstance(target, CacheCore) else target.core
    kind = op[0]
    try:
        if kind == "lock":
            tokens = tokens_for(op[1], core.page_size, op[2])
            lease_id, _ = target.lock(tokens)
            leases.append((lease_id, tokens))
        elif kind in ("insert", "load", "load_insert", "release", "prefetch") and leases:
            lease_id, tokens = leases[op[1] % len(leases)]
            if kind == "load_insert":
                target.load(lease_id)
            if kind in ("insert", "load_insert"):
                match = target.match(tokens)
                held = {n.node_id for n in core.lease(lease_id).device_nodes}
                prefix = []
                for node in match.nodes[: match.device_pages]:
                    if node.node_id not in held:
                        break  # only pages this lease pins are safe from the allocation below
                    prefix.append(node.device_page)
                fresh = target.alloc(lease_id, match.num_pages - len(prefix))
                if write_kv is not None:
                    for page, page_hash in zip(fresh, match.page_hashes[len(prefix) :], strict=True):
                        write_kv(page, page_hash)
                target.insert(lease_id, tokens, prefix + fresh)
            elif kind == "load":
                target.load(lease_id)
            elif kind == "prefetch":
                target.prefetch(lease_id)
            else:
                target.release(lease_id)
                leases.remove((lease_id, tokens))
        elif kind == "evict" and target is core:  # not a sequenced engine operation
            core.evict_device(op[1])
            core.evict_host(op[1])
        elif kind == "cap":
            target.set_retention_cap(op[1])
    except (OutOfPages, CacheClosed, UnknownLease):
        pass
