"""The sans-IO, deterministic core of tpcache."""

from tpcache.core.admission import AdmissionError, Admitted, IllegalAdmissionEvent, Materialized, NotAdmitted, Shape
from tpcache.core.cache import CacheCore
from tpcache.core.config import CacheConfig
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
from tpcache.core.treecore.allocator import HostAllocator, OutOfPages, PageAllocator
from tpcache.core.treecore.invariants import InvariantViolation, check

__all__ = [
    "AdmissionError",
    "Admitted",
    "CacheClosed",
    "CacheConfig",
    "CacheCore",
    "HostAllocator",
    "IllegalAdmissionEvent",
    "InvariantViolation",
    "Lease",
    "Materialized",
    "MatchResult",
    "NoCursor",
    "NotAdmitted",
    "OpKind",
    "OutOfPages",
    "PageAllocator",
    "Ready",
    "ReadyNotAdvanced",
    "Shape",
    "Transfer",
    "UnknownLease",
    "check",
]
