"""The sans-IO, deterministic core of tpcache."""

from tpcache.core.allocator import HostAllocator, OutOfPages, PageAllocator
from tpcache.core.cache import CacheCore
from tpcache.core.config import CacheConfig
from tpcache.core.invariants import InvariantViolation, check
from tpcache.core.records import (
    CacheClosed,
    Lease,
    MatchResult,
    NoCursor,
    OpKind,
    Ready,
    ReadyNotAdvanced,
    Transfer,
    UnknownLease,
)

__all__ = [
    "CacheClosed",
    "CacheConfig",
    "CacheCore",
    "HostAllocator",
    "InvariantViolation",
    "Lease",
    "MatchResult",
    "NoCursor",
    "OpKind",
    "OutOfPages",
    "PageAllocator",
    "Ready",
    "ReadyNotAdvanced",
    "Transfer",
    "UnknownLease",
    "check",
]
