"""StorageKey: canonical, versioned, filesystem-safe encoding; bad fields are typed errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpcache.comm.parallel import ParallelGroup, Shard
from tpcache.io.storage.keys import MAX_NAMESPACE_BYTES, StorageKey, StorageKeyError

SAFE_COMPONENT = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _assert_safe(encoded: str) -> None:
    parts = encoded.split("/")
    assert parts[0] == "v1"
    for part in parts:
        assert part not in ("", ".", "..")
        assert set(part) <= SAFE_COMPONENT, part
        assert len(part) <= 255


def test_encode_shape_and_round_trip() -> None:
    k = StorageKey("llama-3", 2, 1, 4, 0xAB)
    assert k.encode() == "v1/n_llama-3/2/1of4/00000000000000ab"
    assert StorageKey.decode(k.encode()) == k
    assert k.shard == Shard(1, 4)


def test_every_rank_of_a_pp_x_tp_group_has_its_own_key_and_plain_tp_keys_are_unchanged() -> None:
    group = ParallelGroup(pp_size=2, tp_size=2)
    keys = [StorageKey.of("llama", 9, group.place(rank), 0xAB) for rank in range(4)]
    assert [k.encode() for k in keys] == [
        "v1/n_llama/9/p0of2/0of2/00000000000000ab",
        "v1/n_llama/9/p0of2/1of2/00000000000000ab",
        "v1/n_llama/9/p1of2/0of2/00000000000000ab",
        "v1/n_llama/9/p1of2/1of2/00000000000000ab",
    ]
    assert [StorageKey.decode(k.encode()).shard.rank for k in keys] == [0, 1, 2, 3]
    # The same page on TP4 or on PP1xTP2 is another key: neither shape can read this one's slices.
    tp4 = {StorageKey.of("llama", 9, Shard(r, 4), 0xAB).encode() for r in range(4)}
    tp2 = {StorageKey.of("llama", 9, Shard(r, 2), 0xAB).encode() for r in range(2)}
    assert not ({k.encode() for k in keys} & (tp4 | tp2))
    assert StorageKey.of("llama", 9, Shard(1, 4), 0xAB) == StorageKey("llama", 9, 1, 4, 0xAB)
    with_cp = StorageKey.of("llama", 9, ParallelGroup(2, 2, 2).place(7), 0xAB)
    assert with_cp.encode() == "v1/n_llama/9/p1of2/c1of2/1of2/00000000000000ab"
    assert StorageKey.decode(with_cp.encode()) == with_cp


@pytest.mark.parametrize(
    "namespace",
    ["../../etc", "a/b", "..", ".", "x\\y", "名前", "a b", "..hidden", "x_6162", "n_x", "", "a..b", "-"],
)
def test_unsafe_namespaces_cannot_escape(namespace: str) -> None:
    k = StorageKey(namespace, 0, 0, 1, 1)
    _assert_safe(k.encode())
    assert StorageKey.decode(k.encode()) == k


@given(
    ns=st.text(max_size=30).filter(lambda s: "\x00" not in s),
    layout=st.integers(0, 2**31 - 1),
    size=st.integers(1, 64),
    data=st.data(),
    page_hash=st.integers(0, 2**64 - 1),
)
def test_round_trip_and_safety_property(ns: str, layout: int, size: int, data, page_hash: int) -> None:
    rank = data.draw(st.integers(0, size - 1))
    stages, contexts = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    place = (data.draw(st.integers(0, stages - 1)), stages, data.draw(st.integers(0, contexts - 1)), contexts)
    k = StorageKey(ns, layout, rank, size, page_hash, *place)
    enc = k.encode()
    _assert_safe(enc)
    assert StorageKey.decode(enc) == k


def test_fields_distinguish_keys() -> None:
    base = StorageKey("ns", 1, 0, 2, 7)
    variants = [
        StorageKey("ns2", 1, 0, 2, 7),
        StorageKey("ns", 2, 0, 2, 7),
        StorageKey("ns", 1, 1, 2, 7),
        StorageKey("ns", 1, 0, 4, 7),
        StorageKey("ns", 1, 0, 2, 8),
        StorageKey("ns", 1, 0, 2, 7, 0, 2),
        StorageKey("ns", 1, 0, 2, 7, 1, 2),
        StorageKey("ns", 1, 0, 2, 7, 0, 4),
        StorageKey("ns", 1, 0, 2, 7, 0, 1, 1, 2),
    ]
    encodings = {base.encode()} | {v.encode() for v in variants}
    assert len(encodings) == 10


@pytest.mark.parametrize(
    "args",
    [
        ("ns", -1, 0, 1, 0),
        ("ns", 0, 1, 1, 0),  # rank must be < size
        ("ns", 0, -1, 1, 0),
        ("ns", 0, 0, 0, 0),
        ("ns", 0, 0, 1, -1),
        ("ns", 0, 0, 1, 2**64),
        ("ns", 0, True, 2, 0),  # bool is not a rank
        ("ns", 0, 0, 1, 1.0),
        (b"ns", 0, 0, 1, 0),
        ("a\x00b", 0, 0, 1, 0),
        ("x" * (MAX_NAMESPACE_BYTES + 1), 0, 0, 1, 0),
        ("ns", 0, 0, 1, 0, 2, 2),  # stage must be < stages
        ("ns", 0, 0, 1, 0, 0, 0),
        ("ns", 0, 0, 1, 0, 0, 1, 1, 1),  # context rank must be < context ranks
    ],
)
def test_invalid_fields_rejected(args: tuple) -> None:
    with pytest.raises(StorageKeyError):
        StorageKey(*args)


@pytest.mark.parametrize(
    "encoded",
    [
        "v1/n_ns/0/0of1/../../../etc/passwd",
        "v1/n_../0/0of1/0000000000000001",
        "v1/n_a..b/0/0of1/0000000000000001",  # canonical form of this namespace is hex
        "v1/x_2f2e2e/0/0of1/000000000000001",  # short hash
        "v1/n_ns/01/0of1/0000000000000001",  # non-canonical int
        "v1/n_ns/0/1of1/0000000000000001",  # rank out of range
        "v2/n_ns/0/0of1/0000000000000001",
        "/v1/n_ns/0/0of1/0000000000000001",
        "v1/n_ns/0/0of1/0000000000000001\x00",
        "v1/x_ff/0/0of1/0000000000000001",  # not UTF-8
        "v1/n_ns/0/0of1/000000000000000A",
        "v1/n_ns/0/p0of1/0of1/0000000000000001",  # one stage is written without a stage component
        "v1/n_ns/0/p2of2/0of1/0000000000000001",  # stage out of range
        "v1/n_ns/0/c0of2/p0of2/0of1/0000000000000001",  # stage before context rank
        "v1/n_ns/0/p00of2/0of1/0000000000000001",
    ],
)
def test_decode_rejects_non_canonical_or_escaping(encoded: str) -> None:
    with pytest.raises(StorageKeyError):
        StorageKey.decode(encoded)
