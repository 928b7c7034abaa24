"""The change feed's names where the vLLM integration imports them; the feed is
``tpcache.core.treecore.feed``."""

from tpcache.core.treecore.feed import HOST, STORAGE, Changes

__all__ = ["HOST", "STORAGE", "Changes"]
