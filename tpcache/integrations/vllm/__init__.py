"""tpcache as a vLLM KV connector (``TPCacheConnector``).

Load it with ``kv_transfer_config={"kv_connector": "TPCacheConnector", "kv_connector_module_path":
"tpcache.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {...}}``. The
options are described in ``tpcache.integrations.vllm.options``. vLLM itself is imported only when
the connector class is asked for, so the options load without it; asking for it first checks that
this vLLM has every hook the connector uses (``tpcache.integrations.vllm.compat``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TPCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "TPCacheConnector":
        from tpcache.integrations.vllm.compat import check_vllm

        check_vllm()  # before anything imports vLLM's connector API: a missing hook is one clear line
        from tpcache.integrations.vllm.connector import TPCacheConnector

        return TPCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
