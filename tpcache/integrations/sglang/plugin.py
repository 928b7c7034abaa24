"""SGLang's plugin entry point (group ``sglang.srt.plugins``): registers ``--radix-cache-backend
tpcache``. SGLang runs it in its engine and in every scheduler process; it only registers a name.
Nothing else happens (no torch.distributed, no threads, no tpcache rank) unless SGLang builds the
cache with that name, which calls ``factory`` in each scheduler process. The one exception is a
measurement for ``scripts/bench_sglang.py``, off unless ``TPCACHE_SGLANG_TIMING`` is set
(``timing.py``).
"""

from __future__ import annotations

import os
from typing import Any

NAME = "tpcache"


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(NAME) is None:  # SGLang may run the plugins of a process twice
        register_radix_cache_backend(NAME, factory)
    timing = os.environ.get("TPCACHE_SGLANG_TIMING")
    if timing:
        from tpcache.integrations.sglang.timing import install

        install(timing)


def factory(ctx: Any) -> Any:
    """SGLang's ``TreeCacheBuildContext`` -> tpcache's prefix cache for this scheduler's TP rank."""
    from tpcache.integrations.sglang.radix import build

    return build(ctx)
