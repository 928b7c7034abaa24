"""tpcache: a tensor-parallel hierarchical prefix KV cache.

``tpcache.Client`` (the service client) is imported lazily, so ``import tpcache`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncClient", "Client"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "AsyncClient"):
        from tpcache import client

        return getattr(client, name)
    raise AttributeError(f"module 'tpcache' has no attribute {name!r}")
