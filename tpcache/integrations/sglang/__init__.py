"""tpcache under SGLang (0.5.23, pinned: the seams below change between releases).

``tpcache.integrations.sglang.storage.TPCacheHiCacheStorage``: tpcache's storage backends (file,
Redis, Mooncake) as the L3 tier of SGLang's own HiCache, chosen with ``--hicache-storage-backend
dynamic`` (see that module for the extra config).

``--radix-cache-backend tpcache`` (``radix``): tpcache as SGLang's prefix cache, one rank per TP
scheduler, with SGLang's KV pool as its device tier; registered by ``plugin`` (the
``sglang.srt.plugins`` entry point). SGLang is imported only by ``storage``, ``radix`` and, when
SGLang runs it, ``plugin.register``.
"""
