"""The tree core: all per-node state of a cache rank (tree structure, tier states, pins, stamps, hits,
component data, eviction candidates and heaps, free pages and slots, digest records, the change
feed), behind one interface that speaks node ids and plain values.

Two backends implement it, chosen once by ``tpcache.core.backend``: ``reference`` (the Python in
this package, the specification) and ``native`` (the C extension ``_node`` built from this package's
C sources)."""
