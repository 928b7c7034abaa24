"""Storage tier (L3): batched page backends with per-key results, and an async executor."""

from tpcache.io.storage.base import (
    MISS_REASONS,
    PUT_REASONS,
    StorageBackend,
    StorageClosedError,
    StorageError,
)
from tpcache.io.storage.buffers import StorageBufferError
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.memory import MemoryBackend
from tpcache.io.storage.worker import StorageCompletion, StorageWorker

__all__ = [
    "MISS_REASONS",
    "PUT_REASONS",
    "FileBackend",
    "MemoryBackend",
    "StorageBackend",
    "StorageBufferError",
    "StorageClosedError",
    "StorageCompletion",
    "StorageError",
    "StorageKey",
    "StorageKeyError",
    "StorageWorker",
]
