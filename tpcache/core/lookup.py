"""A plain lookup: ``CacheCore.match``'s device hit, host hit and device pages, which is all a lookup's
reply needs, without the walk's list of every node found (in C where built: ``_lookup.c``, which
reads the tree node by node from the root). Pure, like ``match``; tests hold the two equal."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from tpcache.core.hashing import TokenIds, as_token_bytes

if TYPE_CHECKING:
    from tpcache.core.cache import CacheCore

try:
    from tpcache.core import _node as _native
except ImportError:  # built without a C compiler
    _native = None  # type: ignore[assignment]


def lookup(core: CacheCore, tokens: TokenIds) -> tuple[int, int, array]:
    """(device pages, host pages, the device prefix's page ids) of ``core.match(tokens)``."""
    if _native is not None and core.hybrid is None and not core.closed:  # (components: the hit rule's)
        found = _native.lookup(core.tree.root, as_token_bytes(tokens), core.page_size * 4, not core.staging.enabled)
        if found is not None:
            return found
    m = core.match(tokens)
    return m.device_pages, m.host_pages, m.device_page_array
