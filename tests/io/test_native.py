"""The native row copy: byte-exact against a reference, merged runs, and bad plans rejected before
anything is copied (bounds, overlap, lengths, dtypes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tpcache.io import native
from tpcache.io.kv_pool import DevicePool, HostPool, KVLayout, cpu_zeros

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="the native row copy was not built")

LAYOUT = KVLayout(num_layers=3, heads_per_rank=2, head_dim=5, dtype="float16", page_size=3)  # 60-byte rows


def _offsets(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_whole_pages_and_single_layers_match_the_reference(
    monkeypatch: pytest.MonkeyPatch, stream: bool, host_layout: str
) -> None:
    monkeypatch.setattr(native, "STREAM_BYTES", 0 if stream else 1 << 40)
    dev = DevicePool(LAYOUT, 16, "cpu")
    host = HostPool(LAYOUT, 20, host_layout)  # type: ignore[arg-type]
    dev.kv.view(torch.uint8).random_(generator=torch.Generator().manual_seed(1))
    rng = random.Random(host_layout)
    pages = torch.tensor(rng.sample(range(16), 9))
    slots = torch.tensor(rng.sample(range(20), 9))
    native.RowCopy.build(dev, pages, host, slots, None).run(host.kv, dev.kv)
    for page, slot in zip(pages.tolist(), slots.tolist(), strict=True):
        assert torch.equal(host.read_page(slot), dev.read_page(page))
    # one layer back into other pages, shifted per layer like a load
    back = torch.tensor(rng.sample(range(16), 9))
    dev_before = dev.kv.clone()
    rows = native.RowCopy.build(host, slots, dev, back, layer=0)
    rows.run(dev.kv, host.kv, 2 * dev.layer_row_stride, 2 * host.layer_row_stride)
    for page, slot in zip(back.tolist(), slots.tolist(), strict=True):
        assert torch.equal(dev.k(2, page).view(torch.uint8), host.k(2, slot).view(torch.uint8))
        assert torch.equal(dev.v(2, page).view(torch.uint8), host.v(2, slot).view(torch.uint8))
        assert torch.equal(dev.k(0, page).view(torch.uint8), dev_before[0, 0, page].view(torch.uint8))


def test_rows_are_read_in_source_order_and_runs_merge() -> None:
    dev = DevicePool(LAYOUT, 8, "cpu")
    host = HostPool(LAYOUT, 8, "page_first")
    rows = native.RowCopy.build(host, torch.tensor([5, 1, 2]), dev, torch.tensor([0, 4, 6]), None)
    assert list(rows.src) == sorted(rows.src)  # page-first source: pages ascending, rows in page order
    row = LAYOUT.row_bytes
    src = torch.arange(4 * row, dtype=torch.uint8)
    dst = torch.zeros(4 * row, dtype=torch.uint8)
    # rows 0, 1 continue each other on both sides (one copy), row 3 stands alone
    native._rowcopy.copy_rows(  # type: ignore[union-attr]
        dst.data_ptr(), dst.numel(), _offsets([0, row, 3 * row]), src.data_ptr(), src.numel(),
        _offsets([row, 2 * row, 0]), row, 0, 0, True,
    )  # fmt: skip
    assert torch.equal(dst[: 2 * row], src[row : 3 * row])
    assert torch.equal(dst[3 * row :], src[:row])
    assert not dst[2 * row : 3 * row].any()


@pytest.mark.parametrize(
    ("dst_offsets", "src_offsets", "dst_delta", "message"),
    [
        ([0, 64], [0, 63 * 64 + 1], 0, "source row 1"),  # one byte past the end of the source
        ([64 * 64], [0], 0, "destination row 0"),  # exactly one row past the end
        ([0], [0], -1, "destination row 0"),  # a delta that leaves the buffer
        ([0, 64], [0], 0, "has 2 rows"),
    ],
)
def test_bad_plans_raise_and_copy_nothing(dst_offsets, src_offsets, dst_delta: int, message: str) -> None:
    src = torch.full((64 * 64,), 7, dtype=torch.uint8)
    dst = torch.zeros(64 * 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        native._rowcopy.copy_rows(  # type: ignore[union-attr]
            dst.data_ptr(), dst.numel(), _offsets(dst_offsets), src.data_ptr(), src.numel(),
            _offsets(src_offsets), 64, dst_delta, 0, False,
        )  # fmt: skip
    assert not dst.any()


def test_overlapping_buffers_and_wrong_offset_types_are_refused() -> None:
    buf = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        native._rowcopy.copy_rows(  # type: ignore[union-attr]
            buf.data_ptr() + 512, 512, _offsets([0]), buf.data_ptr(), 600, _offsets([0]), 64, 0, 0, False
        )
    other = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int64"):
        native._rowcopy.copy_rows(  # type: ignore[union-attr]
            other.data_ptr(), 1024, np.zeros(1, np.int32), buf.data_ptr(), 1024, _offsets([0]), 64, 0, 0, False
        )
    with pytest.raises(ValueError, match="contiguous CPU"):
        native.RowCopy(_offsets([0]), _offsets([0]), 4).run(other[::2], buf)


def test_pool_memory_is_zeroed_and_huge_page_aligned() -> None:
    kv = cpu_zeros((3, 1 << 20), torch.float16)  # 6 MiB: the huge-page path
    assert kv.data_ptr() % (2 << 20) == 0 and kv.is_contiguous() and not kv.any()
    kv.fill_(1)
    assert int(kv.sum(dtype=torch.float64)) == 3 << 20
    small = cpu_zeros((4, 4), torch.float32)
    assert not small.any()


def test_negative_sizes_and_overflowing_deltas_are_refused() -> None:
    src = torch.zeros(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="non-negative"):
        native._rowcopy.copy_rows(  # type: ignore[union-attr]
            dst.data_ptr(), -1, _offsets([0]), src.data_ptr(), 256, _offsets([0]), 64, 0, 0, False
        )
    with pytest.raises(ValueError, match="destination row 0"):
        native._rowcopy.copy_rows(  # type: ignore[union-attr]
            dst.data_ptr(), 256, _offsets([2**62]), src.data_ptr(), 256, _offsets([0]), 64, 2**62, 0, False
        )


BAD_LISTS = [
    ([0, 1], [2]),  # lengths differ
    ([0, 99], [1, 2]),  # device page out of range
    ([-1, 2], [1, 2]),
    ([0, 0], [1, 2]),  # duplicate
    ([0, 1], [3, 3]),
    ([0, 1.0], [1, 2]),  # not an int
    ([True], [1]),
    ([0, 2**70], [1, 2]),
    ([0, 99], [5, 5]),  # both sides bad: the device side is reported first
    ([0, 1], [1, 2, 3, 3]),  # a bad destination beats the length mismatch
    ((0, 1), (4, 5)),  # tuples are fine
    (list(range(17)), list(range(17))),  # longer than the device pool: never planned in C
    ([], []),
]


@pytest.mark.parametrize(("pages", "slots"), BAD_LISTS)
def test_planning_in_c_refuses_what_check_pages_refuses_with_the_same_words(pages, slots) -> None:
    from tpcache.io.errors import PageIndexError
    from tpcache.io.transfer import TransferEngine

    outcomes = []
    for use_native in (True, False):
        dev = DevicePool(LAYOUT, 16, "cpu")
        host = HostPool(LAYOUT, 20, "page_first")
        with TransferEngine(dev, host, use_native=use_native) as engine:
            try:
                engine.submit_backup(1, pages, slots).wait(30)
                engine.submit_load(2, slots, pages).wait(30)
                outcomes.append("ok")
            except PageIndexError as exc:
                outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
