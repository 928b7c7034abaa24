"""The shard layout's records in C (``tpcache.io._record``) against the Python path they replace: the
same record bytes as the split and ``encode_header``, the same pages as ``_assemble``, and every
damaged, truncated, forged or foreign record refused where the Python check refuses it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tpcache.comm.parallel import Shard
from tpcache.core.backend import RECORD
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import StorageKey
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.memory import MemoryBackend
from tpcache.io.storage.record import HEADER_SIZE, RecordError, check_value, encode_header, payload_checksum
from tpcache.io.storage.sharded import ModelShape, ShardedStorage

pytestmark = pytest.mark.skipif(RECORD is None, reason="the native record code is not built here (reference core)")

OK, CORRUPT, OTHER = 0, 1, 2


def engine_order(layers: int, heads: int, width: int, page: int):
    """A page view for an engine that keeps a page as ``[layers, page, 2, heads, width]``."""

    def view(flat: torch.Tensor) -> torch.Tensor:
        return flat.view(layers, page, 2, heads, width).permute(0, 2, 1, 3, 4)

    return view


# (layers, kv heads, head dim, dtype, page size, tp size, tp rank, granularity, engine order)
SHAPES = [
    (1, 8, 128, torch.bfloat16, 16, 1, 0, {}, False),  # the benchmark's 64 KiB page
    (16, 8, 128, torch.bfloat16, 16, 1, 0, {}, False),  # its 1 MiB page: 4 layers a shard
    (4, 4, 8, torch.float16, 4, 2, 1, {"heads_per_shard": 2, "layers_per_shard": 2}, False),
    (4, 4, 8, torch.float32, 4, 4, 3, {}, False),  # one head a rank: rows of a shard follow each other
    (4, 4, 8, torch.float16, 4, 1, 0, {}, True),
]


def storage(shape: tuple) -> ShardedStorage:
    layers, heads, dim, dtype, page, tp, rank, granularity, engine = shape
    lay = KVLayout.from_model(layers, heads, dim, tp, dtype, page)
    model = ModelShape.of_rank("native-test", lay, Shard(rank, tp), **granularity)
    view = engine_order(layers, lay.heads_per_rank, dim * lay.itemsize, page) if engine else None
    return ShardedStorage(MemoryBackend(), model, Shard(rank, tp), lay, page_view=view)


def batch(store: ShardedStorage, pages: int, seed: int = 0) -> tuple[list[torch.Tensor], list[bytes], list[bytes]]:
    """Random pages, their shards' key echoes, and each shard's record as the Python path writes it."""
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, 256, (store.layout.page_bytes,), dtype=torch.uint8, generator=g) for _ in range(pages)]
    keys = [StorageKey("native-test", 1, 0, 1, 1000 + i) for i in range(pages)]
    echoes = store._echoes(keys)
    assert echoes == [k.encode().encode("ascii") for k in store._all_keys(keys)]
    split = store._split([store._page(p, writable=False) for p in data])
    shards = [bytes(byte_view(s)) for s in split]
    records = [encode_header(e, 0, len(s), payload_checksum(s)) + s for e, s in zip(echoes, shards, strict=True)]
    return data, echoes, records


def python_accepts(value: object, echo: bytes, payload_len: int) -> bool:
    """The Python path's verdict on one value: a live record of this key whose payload checks."""
    if not isinstance(value, bytes):
        return False
    try:
        want, _ = check_value(value, echo, payload_len)
    except RecordError:
        return False
    return payload_checksum(value[HEADER_SIZE + len(echo) :]) == want


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}l{s[1]}h-tp{s[5]}r{s[6]}{'-engine' if s[8] else ''}")
def test_records_and_pages_equal_the_python_paths(shape: tuple) -> None:
    store = storage(shape)
    assert store._geometry is not None
    data, echoes, records = batch(store, 3)
    flats = [store._flat(p, writable=False) for p in data]
    places = store._places_of(len(data))
    assert RECORD.encode_records(echoes, flats, places, store._geometry) == records
    # into one buffer at given offsets, as a transfer buffer is filled
    sizes = [len(r) for r in records]
    at = np.cumsum([0, *[s + 7 for s in sizes[:-1]]]).astype(np.int64)
    out = bytearray(int(at[-1]) + sizes[-1])
    assert RECORD.encode_records(echoes, flats, places, store._geometry, out, at.tobytes()) is None
    assert [bytes(out[a : a + s]) for a, s in zip(at, sizes, strict=True)] == records
    # read back into pages as the Python path assembles them, checked in place or first copied
    for stable in (True, False):
        outs = [torch.full((store.layout.page_bytes,), 0xAA, dtype=torch.uint8) for _ in data]
        codes = RECORD.scatter_check(
            records, echoes, [store._flat(o, writable=True) for o in outs], places, store._geometry, stable
        )
        assert codes == bytes(len(records))
        assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))


def test_every_damaged_truncated_forged_or_foreign_record_is_refused_as_the_python_check_refuses_it() -> None:
    store = storage(SHAPES[2])
    data, echoes, records = batch(store, 2)
    payload = store.model.shard_bytes
    page = store.layout.page_bytes
    rng = random.Random(7)
    record, echo = records[0], echoes[0]
    end = HEADER_SIZE + len(echo)

    def flipped(pos: int) -> bytes:
        b = bytearray(record)
        b[pos] ^= 1 << rng.randrange(8)
        return bytes(b)

    cases: list[object] = [flipped(pos) for pos in range(end)]  # every header and key echo byte
    cases += [flipped(pos) for pos in rng.sample(range(end, len(record)), 16)]  # payload bytes
    cases += [record[:n] for n in (0, 1, 4, HEADER_SIZE - 1, HEADER_SIZE, end - 1, end, len(record) - 1)]
    cases += [record + b"\0", b"TPCX" + record[4:], records[1], None, 5, ValueError("WRONGTYPE")]
    other = storage(SHAPES[3])  # another model's record of the same size is not this key's
    cases.append(batch(other, 1)[2][0])
    first = store._places_of(1)[:16]  # shard 0 of a page
    zero = bytes(payload)
    corrupt_rows = bytearray(b"\xaa" * page)  # the page once shard 0's rows are cleared
    cleared = encode_header(echo, 0, payload, payload_checksum(zero)) + zero
    assert RECORD.scatter_check([cleared], [echo], [corrupt_rows], first, store._geometry, True) == b"\0"
    for value in cases:
        for stable in (True, False):
            out = bytearray(b"\xaa" * page)
            code = RECORD.scatter_check([value], [echo], [out], first, store._geometry, stable)[0]
            accepted = python_accepts(value, echo, payload)
            assert (code == OK) == accepted, (code, len(value) if isinstance(value, bytes) else value)
            assert value == record or not accepted
            if code == CORRUPT:  # a payload that fails its checksum: its rows hold zeros, nothing else moved
                assert isinstance(value, bytes) and value[:end] == record[:end] and len(value) == len(record)
                assert out == corrupt_rows
            elif code == OTHER:  # not this key's whole live record: nothing written
                assert out == bytearray(b"\xaa" * page)


def test_bad_places_sizes_and_geometries_are_refused_before_anything_is_written() -> None:
    store = storage(SHAPES[2])
    data, echoes, records = batch(store, 1)
    g, per = store._geometry, len(store._ranges)
    good = np.frombuffer(store._places_of(1), dtype=np.int64).reshape(per, 2)
    page = store.layout.page_bytes

    def places(row: int, page_index: int, offset: int) -> bytes:
        p = good.copy()
        p[row] = (page_index, offset)
        return p.tobytes()

    bad_places = [
        places(0, 1, 0),  # no such page
        places(0, -1, 0),
        places(1, 0, -1),
        places(per - 1, 0, page),  # rows past the page's end
        places(per - 1, 0, int(good[per - 1, 1]) + 1) if g[0] < page else places(0, 0, 1),
        good.tobytes()[:-8],
        good.tobytes() + bytes(16),
    ]
    for where in bad_places:
        out = bytearray(b"\xaa" * page)
        with pytest.raises(ValueError):
            RECORD.scatter_check(records, echoes, [out], where, g, True)
        with pytest.raises(ValueError):
            RECORD.encode_records(echoes, [bytes(page)], where, g)
        assert out == bytearray(b"\xaa" * page)
    for geometry in [
        (0, *g[1:]),
        (g[0], 0, *g[2:]),
        (g[0], g[1], -1, *g[3:]),
        (1 << 62, 4, 1, 4, 1, 4, 1, 4, 1),
        g[:8],
    ]:
        with pytest.raises((ValueError, TypeError)):
            RECORD.scatter_check(records, echoes, [bytearray(page)], store._places_of(1), geometry, True)
    size = sum(len(r) for r in records)
    at = np.cumsum([0, *[len(r) for r in records[:-1]]]).astype(np.int64)
    for out, where in ((bytearray(size - 1), at), (bytearray(size), at[:-1]), (bytearray(size), at - 1)):
        with pytest.raises(ValueError):  # a record that would not fit the buffer, or no place for one
            RECORD.encode_records(echoes, [bytes(page)], store._places_of(1), g, out, where.tobytes())
        assert out == bytearray(len(out))
    for bad_page in ((0, page), (1 << 40, -1), (1,), ("a", page)):  # a tensor's (address, bytes) form
        with pytest.raises((ValueError, TypeError)):
            RECORD.scatter_check(records, echoes, [bad_page], store._places_of(1), g, True)
    short = torch.zeros(page - 1, dtype=torch.uint8)  # a page of another size is refused before any call
    with pytest.raises(ValueError):
        store._flat(short, writable=True)
    with pytest.raises(ValueError):  # one value per echo
        RECORD.scatter_check(records[:-1], echoes, [bytearray(page)], store._places_of(1), g, True)
    with pytest.raises(BufferError):  # pages are writable for a read
        RECORD.scatter_check(records, echoes, [bytes(page)], store._places_of(1), g, True)
    with pytest.raises(ValueError):  # an echo longer than a record's key can be
        RECORD.encode_records([b"k" * 1025] + echoes[1:], [bytes(page)], store._places_of(1), g)
