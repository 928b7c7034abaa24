"""Storage tier (L3): batched page backends with per-key results, and an async executor.

Backends: ``FileBackend`` (local disk), ``MooncakeBackend`` and ``RedisBackend`` (stores that span
machines), ``MemoryBackend`` (tests); ``open_storage(url, shard=...)`` builds one from a storage URL.
"""

from tpcache.io.storage.base import (
    MISS_REASONS,
    PUT_REASONS,
    StorageBackend,
    StorageClosedError,
    StorageError,
    StorageInUse,
)
from tpcache.io.storage.buffers import StorageBufferError
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.memory import MemoryBackend
from tpcache.io.storage.mooncake_store import MooncakeBackend
from tpcache.io.storage.record import RecordMac
from tpcache.io.storage.redis_store import RedisBackend
from tpcache.io.storage.url import StorageURL, StorageURLError, file_url, open_storage, parse_storage_url
from tpcache.io.storage.worker import StorageCompletion, StorageWorker

__all__ = [
    "MISS_REASONS",
    "PUT_REASONS",
    "FileBackend",
    "MemoryBackend",
    "MooncakeBackend",
    "RecordMac",
    "RedisBackend",
    "StorageBackend",
    "StorageBufferError",
    "StorageClosedError",
    "StorageCompletion",
    "StorageError",
    "StorageInUse",
    "StorageKey",
    "StorageKeyError",
    "StorageURL",
    "StorageURLError",
    "StorageWorker",
    "file_url",
    "open_storage",
    "parse_storage_url",
]
