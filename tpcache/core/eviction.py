"""The eviction policy's parser where the vLLM integration imports it; eviction is
``tpcache.core.treecore.eviction``."""

from tpcache.core.treecore.eviction import make_policy

__all__ = ["make_policy"]
