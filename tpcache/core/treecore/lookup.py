"""A plain lookup: ``CacheCore.match``'s device hit, host hit and device pages, which is all a lookup's
reply needs, without the walk's list of every node found (in C where built: ``_lookup.c``, which
reads the tree node by node from the root). Pure, like ``match``; tests hold the two equal."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from tpcache.core.backend import NATIVE
from tpcache.core.hashing import TokenIds, as_token_bytes

if TYPE_CHECKING:
    from tpcache.core.cache import CacheCore

_native_lookup = NATIVE.lookup if NATIVE is not None else None


def lookup(core: CacheCore, tokens: TokenIds) -> tuple[int, int, array]:
    """(device pages, host pages, the device prefix's page ids) of ``core.match(tokens)``."""
    data = as_token_bytes(tokens)  # once: ``match`` takes the bytes as they are
    if _native_lookup is not None and core.hybrid is None and not core.closed:  # (components: the hit rule's)
        found = _native_lookup(core.tree.root, data, core.page_size * 4, not core.staging.enabled)
        if found is not None:
            return found
    m = core.match(data)
    return m.device_pages, m.host_pages, m.device_page_array
