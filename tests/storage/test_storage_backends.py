"""Contract tests every backend must pass: per-key results, verified reads, eviction, stats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.storage.storage_helpers import make_keys, make_page
from tpcache.io.storage.base import StorageBackend, StorageClosedError
from tpcache.io.storage.buffers import StorageBufferError
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.memory import MemoryBackend

PAGE = 4096


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    b: StorageBackend
    if request.param == "memory":
        b = MemoryBackend()
    else:
        b = FileBackend(tmp_path, capacity_bytes=64 << 20, fsync="batch")
    yield b
    b.close()


def test_round_trip_bytes(backend: StorageBackend) -> None:
    keys = make_keys(8)
    pages = [make_page(i, PAGE) for i in range(8)]
    assert backend.put(keys, pages) == [True] * 8
    assert backend.exists(keys) == [True] * 8
    out = [bytearray(PAGE) for _ in keys]
    assert backend.get(keys, out) == [True] * 8
    assert [bytes(o) for o in out] == pages
    s = backend.stats()
    assert (s["puts"], s["put_ok"], s["gets"], s["hits"], s["misses"]) == (8, 8, 8, 8, 0)


def test_round_trip_tensors_zero_copy(backend: StorageBackend) -> None:
    keys = make_keys(3)
    pages = [torch.arange(1024, dtype=torch.float32) * (i + 1) for i in range(3)]
    assert backend.put(keys, pages) == [True] * 3
    out = torch.zeros(3, 1024, dtype=torch.float32)
    # Rows of one tensor: get must write into the caller's memory, not a copy.
    assert backend.get(keys, [out[0], out[1], out[2]]) == [True] * 3
    for i in range(3):
        assert torch.equal(out[i], pages[i])
    bf = torch.randn(64, 8).to(torch.bfloat16)
    assert backend.put(make_keys(1, base=100), [bf]) == [True]
    back = torch.empty_like(bf)
    assert backend.get(make_keys(1, base=100), [back]) == [True]
    assert torch.equal(back, bf)


def test_batch_results_are_per_key(backend: StorageBackend) -> None:
    keys = make_keys(4)
    assert backend.put([keys[0], keys[2]], [make_page(0, PAGE), make_page(2, PAGE)]) == [True, True]
    out = [bytearray(PAGE) for _ in keys]
    assert backend.get(keys, out) == [True, False, True, False]
    assert backend.exists(keys) == [True, False, True, False]
    assert bytes(out[0]) == make_page(0, PAGE) and bytes(out[2]) == make_page(2, PAGE)
    s = backend.stats()
    assert s["misses_missing"] == 2 and s["hits"] == 2
    assert backend.delete([keys[0], keys[1]]) == [True, False]
    assert backend.exists(keys) == [False, False, True, False]


def test_wrong_size_buffer_is_a_foreign_miss(backend: StorageBackend) -> None:
    keys = make_keys(1)
    backend.put(keys, [make_page(0, PAGE)])
    out = bytearray(b"\xee" * (PAGE // 2))
    assert backend.get(keys, [out]) == [False]
    assert backend.stats()["misses_foreign"] == 1
    assert out == bytearray(b"\xee" * (PAGE // 2))  # no stored bytes leaked into it


def test_overwrite_replaces_page(backend: StorageBackend) -> None:
    keys = make_keys(1)
    backend.put(keys, [make_page(1, PAGE)])
    backend.put(keys, [make_page(2, PAGE)])
    out = [bytearray(PAGE)]
    assert backend.get(keys, out) == [True]
    assert bytes(out[0]) == make_page(2, PAGE)


def test_caller_bugs_are_typed_errors(backend: StorageBackend) -> None:
    keys = make_keys(2)
    with pytest.raises(ValueError):
        backend.put(keys, [make_page(0, PAGE)])
    with pytest.raises(StorageKeyError):
        backend.exists(["v1/n_ns/0/0of1/0000000000000001"])  # type: ignore[list-item]
    with pytest.raises(StorageBufferError):
        backend.get(keys[:1], [b"read-only"])
    with pytest.raises(StorageBufferError):
        backend.put(keys[:1], [torch.zeros(4, 4).t()])  # not contiguous
    with pytest.raises(StorageBufferError):
        backend.put(keys[:1], [object()])
    assert backend.stats()["puts"] == 0  # nothing was attempted


def test_closed_backend_refuses(backend: StorageBackend) -> None:
    backend.close()
    with pytest.raises(StorageClosedError):
        backend.exists(make_keys(1))


def test_memory_capacity_evicts_lru_in_access_order() -> None:
    b = MemoryBackend(capacity_bytes=4 * PAGE)
    keys = make_keys(6)
    assert b.put(keys[:4], [make_page(i, PAGE) for i in range(4)]) == [True] * 4
    assert b.get([keys[0]], [bytearray(PAGE)]) == [True]  # 0 becomes most recent
    assert b.put(keys[4:6], [make_page(i, PAGE) for i in (4, 5)]) == [True, True]
    assert b.exists(keys) == [True, False, False, True, True, True]
    assert b.stats()["evictions"] == 2


def test_memory_batch_never_evicts_its_own_pages() -> None:
    b = MemoryBackend(capacity_bytes=2 * PAGE)
    keys = make_keys(3)
    assert b.put(keys, [make_page(i, PAGE) for i in range(3)]) == [True, True, False]
    assert b.stats()["put_failures_no_space"] == 1
    assert b.put(make_keys(1, base=50), [bytes(3 * PAGE)]) == [False]
    assert b.stats()["put_failures_too_large"] == 1


def test_memory_fault_injection() -> None:
    b = MemoryBackend()
    keys = make_keys(4)
    b.fail_puts([keys[1]], "no_space")
    b.lose_puts([keys[2]])
    assert b.put(keys, [make_page(i, PAGE) for i in range(4)]) == [True, False, True, True]
    assert b.stats()["put_failures_no_space"] == 1
    b.corrupt([keys[3]])
    b.drop([keys[0]])
    out = [bytearray(PAGE) for _ in keys]
    assert b.get(keys, out) == [False, False, False, False]
    s = b.stats()
    assert (s["misses_missing"], s["misses_corrupt"]) == (3, 1)
    assert out[3] == bytearray(PAGE)  # corrupt bytes never reach the caller
    b.clear_faults()
    assert b.put(keys[1:3], [make_page(1, PAGE), make_page(2, PAGE)]) == [True, True]
    assert b.exists(keys) == [False, True, True, False]


def test_keys_of_another_shard_rejected_by_bound_file_backend(tmp_path: Path) -> None:
    with FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(0, 2)) as b, pytest.raises(StorageKeyError):
        b.put([StorageKey("ns", 1, 1, 2, 5)], [make_page(0, PAGE)])
