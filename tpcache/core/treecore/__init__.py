"""The tree core: all per-node state of a cache rank (tree structure, tier states, pins, stamps, hits,
component data, eviction candidates and heaps, free pages and slots, digest records, the change
feed), behind one interface that speaks node ids and plain values.

Two backends implement it, chosen once by ``tpcache.core.backend``: ``reference`` (the Python in
this package, the specification) and ``native`` (the C extension ``_node`` built from this package's
C sources)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpcache.core.treecore.core import NodeView, TreeCore

__all__ = ["NodeView", "TreeCore"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: ``backend`` imports this package's extension while it chooses, before the
    # modules that ask it for the choice can be imported.
    if name in __all__:
        from tpcache.core.treecore import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
