"""KV layouts and pools: sizes, shapes, canonical page bytes, zero-copy views and input validation."""

from __future__ import annotations

import pytest
import torch

from tpcache.io.errors import KVLayoutError, PageIndexError
from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout, parse_dtype

LAYOUT = KVLayout(num_layers=3, heads_per_rank=2, head_dim=8, dtype="bfloat16", page_size=4)


def random_page(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8, generator=gen)


def test_layout_sizes() -> None:
    assert LAYOUT.dtype is torch.bfloat16
    assert LAYOUT.row_bytes == 4 * 2 * 8 * 2
    assert LAYOUT.layer_page_bytes == 2 * LAYOUT.row_bytes
    assert LAYOUT.page_bytes == 3 * 2 * 4 * 2 * 8 * 2
    assert LAYOUT.page_shape == (3, 2, 4, 2, 8)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("torch.float32", torch.float32),
        ("bf16", torch.bfloat16),
    ],
)
def test_dtype_names(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype
    assert KVLayout(1, 1, 1, name, 1).dtype is dtype


@pytest.mark.parametrize("dtype", ["nonsense", "bool", torch.complex64, 3])
def test_bad_dtype(dtype: object) -> None:
    with pytest.raises(KVLayoutError):
        KVLayout(1, 1, 1, dtype, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["num_layers", "heads_per_rank", "head_dim", "page_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_sizes(field: str, value: object) -> None:
    args = {"num_layers": 2, "heads_per_rank": 2, "head_dim": 4, "dtype": "float16", "page_size": 2}
    args[field] = value
    with pytest.raises(KVLayoutError, match=field):
        KVLayout(**args)  # type: ignore[arg-type]


def test_from_model_shards_heads() -> None:
    layout = KVLayout.from_model(num_layers=4, num_kv_heads=8, head_dim=128, tp_size=4, dtype="float16")
    assert layout.heads_per_rank == 2
    assert layout.page_bytes == 4 * 2 * 16 * 2 * 128 * 2
    with pytest.raises(KVLayoutError, match="split evenly"):
        KVLayout.from_model(num_layers=4, num_kv_heads=6, head_dim=128, tp_size=4)


def test_pool_shapes() -> None:
    dev = DevicePool(LAYOUT, 5, "cpu")
    assert tuple(dev.kv.shape) == (3, 2, 5, 4, 2, 8)
    lf = HostPool(LAYOUT, 7, "layer_first")
    pf = HostPool(LAYOUT, 7, "page_first")
    assert tuple(lf.kv.shape) == (3, 2, 7, 4, 2, 8)
    assert tuple(pf.kv.shape) == (7, 3, 2, 4, 2, 8)
    assert pf.num_slots == 7 and not pf.pinned
    with pytest.raises(KVLayoutError, match="host layout"):
        HostPool(LAYOUT, 7, "columnar")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_needs_cuda() -> None:
    with pytest.raises(KVLayoutError, match="CUDA"):
        HostPool(LAYOUT, 2, pin_memory=True)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_canonical_bytes_agree_across_pools(host_layout: str) -> None:
    dev = DevicePool(LAYOUT, 4, "cpu")
    host = HostPool(LAYOUT, 4, host_layout)  # type: ignore[arg-type]
    data = random_page(LAYOUT, 1)
    dev.write_page(2, data)
    host.write_page(3, bytes(data.tolist()))
    assert torch.equal(dev.read_page(2), data)
    assert torch.equal(host.read_page(3), data)
    # canonical order: layer-major, K then V
    row = LAYOUT.row_bytes
    for layer in range(LAYOUT.num_layers):
        # compare bit patterns (int16 views): random bytes include NaNs
        k = data[(2 * layer) * row : (2 * layer + 1) * row].view(torch.int16).view(LAYOUT.token_shape)
        v = data[(2 * layer + 1) * row : (2 * layer + 2) * row].view(torch.int16).view(LAYOUT.token_shape)
        for pool, page in ((dev, 2), (host, 3)):
            assert torch.equal(pool.k(layer, page).view(torch.int16), k)
            assert torch.equal(pool.v(layer, page).view(torch.int16), v)
    # neighbours untouched
    assert not dev.read_page(1).any() and not host.read_page(2).any()


def test_page_view_is_zero_copy() -> None:
    host = HostPool(LAYOUT, 3, "page_first")
    view = host.page_view(1)
    assert view.dtype is torch.uint8 and view.numel() == LAYOUT.page_bytes
    data = random_page(LAYOUT, 2)
    view.copy_(data)
    assert torch.equal(host.read_page(1), data)
    mv = host.page_memoryview(2)
    mv[:] = bytes(data.flip(0).tolist())
    assert torch.equal(host.read_page(2), data.flip(0))
    with pytest.raises(KVLayoutError, match="page_first"):
        HostPool(LAYOUT, 3, "layer_first").page_view(0)


def test_from_tensor_wraps_without_copy() -> None:
    kv = torch.zeros((3, 2, 6, 4, 2, 8), dtype=torch.bfloat16)
    pool = DevicePool.from_tensor(LAYOUT, kv)
    assert pool.num_pages == 6 and pool.kv.data_ptr() == kv.data_ptr()
    pool.write_page(5, random_page(LAYOUT, 3))
    assert kv[:, :, 5].any()
    with pytest.raises(KVLayoutError, match="dtype"):
        DevicePool.from_tensor(LAYOUT, kv.float())
    with pytest.raises(KVLayoutError, match="shape"):
        DevicePool.from_tensor(LAYOUT, torch.zeros((3, 2, 6, 4, 2, 4), dtype=torch.bfloat16))
    with pytest.raises(KVLayoutError, match="6-D"):
        DevicePool.from_tensor(LAYOUT, torch.zeros((3, 2, 6), dtype=torch.bfloat16))
    with pytest.raises(KVLayoutError, match="contiguous"):
        DevicePool.from_tensor(LAYOUT, torch.zeros((3, 2, 4, 2, 8, 6), dtype=torch.bfloat16).movedim(-1, 2))


def test_page_list_validation() -> None:
    dev = DevicePool(LAYOUT, 5, "cpu")
    assert dev.check_pages([4, 0, 2]).tolist() == [4, 0, 2]
    assert dev.check_pages(torch.tensor([1, 3], dtype=torch.int32)).dtype is torch.int64
    with pytest.raises(PageIndexError, match="out of range"):
        dev.check_pages([0, 5])
    with pytest.raises(PageIndexError, match="out of range"):
        dev.check_pages([-1])
    with pytest.raises(PageIndexError, match="more than once"):
        dev.check_pages([1, 2, 1])
    with pytest.raises(PageIndexError, match="ints"):
        dev.check_pages([1, True])
    with pytest.raises(PageIndexError, match="integers"):
        dev.check_pages(torch.tensor([1.0]))
    with pytest.raises(PageIndexError):
        dev.read_page(5)
    with pytest.raises(KVLayoutError, match="bytes"):
        dev.write_page(0, b"short")


def test_odd_row_sizes_use_narrow_rows() -> None:
    layout = KVLayout(num_layers=2, heads_per_rank=1, head_dim=3, dtype="float16", page_size=1)
    dev = DevicePool(layout, 3, "cpu")
    assert layout.row_bytes == 6 and dev.row_dtype is torch.int16
    data = random_page(layout, 4)
    dev.write_page(1, data)
    assert torch.equal(dev.read_page(1), data)
