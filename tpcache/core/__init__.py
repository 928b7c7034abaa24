"""The sans-IO, deterministic core of tpcache."""

from tpcache.core.allocator import HostAllocator, OutOfPages, PageAllocator
from tpcache.core.cache import CacheClosed, CacheCore, Lease, MatchResult, OpKind, Transfer, UnknownLease
from tpcache.core.config import CacheConfig
from tpcache.core.invariants import InvariantViolation, check

__all__ = [
    "CacheClosed",
    "CacheConfig",
    "CacheCore",
    "HostAllocator",
    "InvariantViolation",
    "Lease",
    "MatchResult",
    "OpKind",
    "OutOfPages",
    "PageAllocator",
    "Transfer",
    "UnknownLease",
    "check",
]
