"""The embedded API: one TPCache per TP rank."""

from tpcache.engine.tpcache import LoadResult, TPCache, layout_version

__all__ = ["LoadResult", "TPCache", "layout_version"]
