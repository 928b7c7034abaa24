"""A KV pool the host cannot hold fails before it is allocated, with both sizes in the message."""

from __future__ import annotations

import pytest

from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout
from tpcache.io.memory import PoolMemoryError, available_memory, format_bytes

LAYOUT = KVLayout.from_model(num_layers=32, num_kv_heads=8, head_dim=128, tp_size=1, dtype="bfloat16", page_size=16)


def test_a_pool_larger_than_the_machine_is_refused_with_its_size() -> None:
    have = available_memory()
    assert have is not None
    pages = have // LAYOUT.page_bytes + 1024
    need = format_bytes(pages * LAYOUT.page_bytes)
    with pytest.raises(PoolMemoryError, match=rf"^the host pool needs {need}, but this machine has .* available"):
        HostPool(LAYOUT, pages)
    with pytest.raises(PoolMemoryError, match=rf"^the device pool needs {need}"):
        DevicePool(LAYOUT, pages, "cpu")
    assert DevicePool(LAYOUT, 2, "cpu").num_pages == 2  # a pool that fits is built as before
