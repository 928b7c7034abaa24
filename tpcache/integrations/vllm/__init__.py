"""tpcache as a vLLM KV connector (``TPCacheConnector``).

Load it with ``kv_transfer_config={"kv_connector": "TPCacheConnector", "kv_connector_module_path":
"tpcache.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {...}}``. The
options are described in ``tpcache.integrations.vllm.options``. vLLM itself is imported only when
the connector class is asked for, so the options and messages load without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TPCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "TPCacheConnector":
        from tpcache.integrations.vllm.connector import TPCacheConnector

        return TPCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
