"""tpcache under SGLang (0.5.23, pinned: the seams below change between releases).

``tpcache.integrations.sglang.storage.TPCacheHiCacheStorage``: tpcache's storage backends (file,
Redis, Mooncake) as the L3 tier of SGLang's own HiCache, chosen with ``--hicache-storage-backend
dynamic`` (see that module for the extra config). SGLang is imported only by that module.
"""
