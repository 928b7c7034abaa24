"""Storage trust: with a storage key every record carries a keyed MAC, so a value someone wrote
behind tpcache (a forged page with valid checksums, a genuine record copied under another key) is
a counted miss on every backend; without a key the checksums alone decide, which catches accidents
only."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.storage.storage_helpers import make_keys, make_page
from tests.store.conftest import store_url
from tpcache.io.storage import FileBackend, RecordMac, StorageBackend, StorageKey, open_storage
from tpcache.io.storage.record import MIN_KEY_BYTES, encode_header, payload_checksum
from tpcache.service.config import ConfigError, resolve

pytestmark = pytest.mark.xdist_group("store")
PAGE = 4096
SECRET = b"deployment-secret-of-32-bytes..."
OTHER = b"someone-elses-secret-32-bytes..."

# A store, with a way to write raw values behind tpcache: (open with key, raw put) per backend.
Opener = Callable[[bytes | None], StorageBackend]
RawPut = Callable[[StorageKey, bytes], None]


def record(key: StorageKey, payload: bytes, *, secret: bytes | None = None) -> bytes:
    """A record as a writer with the store's client can make it: valid checksums, a MAC under
    ``secret`` (none without)."""
    e = key.encode().encode()
    mac = RecordMac(secret).sign(e, payload) if secret else b""
    return encode_header(e, 0, len(payload), payload_checksum(payload), mac=mac) + payload


@pytest.fixture(params=("file", "mooncake", "redis"))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Opener, RawPut]]:
    opened: list[StorageBackend] = []
    if request.param == "file":
        # The file backend indexes what its directory holds when it opens: a raw value is a
        # segment written while no instance runs (as a user with write access to the directory can).
        pending: list[tuple[StorageKey, bytes]] = []

        def open_file(key: bytes | None) -> StorageBackend:
            for b in opened:
                b.close()
            b = FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1))
            if pending:
                b.close()
                seg = sorted(b._dir.glob("*.seg"))  # type: ignore[attr-defined]
                segno = int(seg[-1].stem) + 1 if seg else 1
                data = b"".join(value for _, value in pending)
                (b._dir / f"{segno:010d}.seg").write_bytes(data)  # type: ignore[attr-defined]
                pending.clear()
                b = FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1))
            if key:
                b.authenticate(RecordMac(key))
            opened.append(b)
            return b

        def raw_file(key: StorageKey, value: bytes) -> None:
            # A file record carries its write sequence: a raw one comes after everything stored.
            seq = (1 << 40) + len(pending)
            value = bytearray(value)
            echo_len = int.from_bytes(value[6:8], "little")
            e, payload = bytes(value[60 : 60 + echo_len]), bytes(value[60 + echo_len :])
            head = bytearray(encode_header(e, seq, len(payload), payload_checksum(payload), mac=bytes(value[44:60])))
            if not any(value[44:60]):
                head = bytearray(encode_header(e, seq, len(payload), payload_checksum(payload)))
            pending.append((key, bytes(head) + payload))

        yield open_file, raw_file
    else:
        sep = "&" if request.param == "mooncake" else "?"
        url = store_url(request, request.param) + f"{sep}prefix={os.getpid()}-{request.node.name[-40:]}/"
        url = url.replace("[", "-").replace("]", "")

        def open_remote(key: bytes | None) -> StorageBackend:
            b = open_storage(url, shard=(0, 1), storage_key=key)
            opened.append(b)
            return b

        def raw_remote(key: StorageKey, value: bytes) -> None:
            b = opened[-1]
            name = b._prefix + key.encode()  # type: ignore[attr-defined]
            if hasattr(b, "_client"):
                b._client.set(name, value)  # type: ignore[attr-defined]
            else:
                assert b._store.upsert(name, value) == 0  # type: ignore[attr-defined]

        yield open_remote, raw_remote
    for b in opened:
        b.close()


def read(b: StorageBackend, key: StorageKey) -> tuple[bool, bytes]:
    out = bytearray(b"\xee" * PAGE)
    ok = b.get([key], [out])[0]
    return ok, bytes(out)


def test_a_forged_record_with_valid_checksums_is_served_without_a_key_and_a_counted_miss_with_one(store) -> None:
    opener, raw = store
    key = make_keys(1)[0]
    forged = make_page(666, PAGE)
    b = opener(None)
    raw(key, record(key, forged))
    b = opener(None)
    assert read(b, key) == (True, forged)  # checksummed, not authenticated: this is what a key is for
    raw(key, record(key, forged))
    b = opener(SECRET)
    ok, out = read(b, key)
    assert not ok and out != forged
    assert b.stats()["misses_unauthenticated"] == 1 and b.stats()["hits"] == 0


def test_a_mac_under_another_key_is_a_counted_miss(store) -> None:
    opener, raw = store
    key = make_keys(1)[0]
    opener(SECRET)
    raw(key, record(key, make_page(5, PAGE), secret=OTHER))
    b = opener(SECRET)
    assert read(b, key)[0] is False
    assert b.stats()["misses_unauthenticated"] == 1


def test_a_genuine_record_copied_under_another_key_is_a_miss(store) -> None:
    opener, raw = store
    a, other = make_keys(2)
    page = make_page(1, PAGE)
    b = opener(SECRET)
    genuine = record(a, page, secret=SECRET)
    raw(a, genuine)
    b = opener(SECRET)
    assert read(b, a) == (True, page)  # what tpcache itself writes under the key: served
    raw(other, genuine)  # the same bytes under another key: its echo names the first key
    b = opener(SECRET)
    assert read(b, other)[0] is False
    s = b.stats()  # in a file segment a record's key is its echo: there, a copy is the first key's
    assert s["misses_foreign"] + s["misses_missing"] == 1 and s["misses_unauthenticated"] == 0
    # Its echo rewritten to the other key and its checksums made valid again: the MAC covers the key.
    raw(other, _reechoed(genuine, a, other))
    b = opener(SECRET)
    assert read(b, other)[0] is False
    assert b.stats()["misses_unauthenticated"] == 1


def _reechoed(genuine: bytes, a: StorageKey, other: StorageKey) -> bytes:
    """``genuine`` (a record of ``a``) with the key echo of ``other``, its MAC kept, checksums valid."""
    ea, eo = a.encode().encode(), other.encode().encode()
    payload = genuine[60 + len(ea) :]
    return encode_header(eo, 0, len(payload), payload_checksum(payload), mac=genuine[44:60]) + payload


def test_records_written_with_a_key_round_trip_and_one_written_without_is_a_miss(store) -> None:
    opener, raw = store
    keys = make_keys(2)
    b = opener(SECRET)
    assert b.put(keys[:1], [make_page(3, PAGE)]) == [True]
    assert read(b, keys[0]) == (True, make_page(3, PAGE))
    raw(keys[1], record(keys[1], make_page(4, PAGE)))  # as an instance without the key writes it
    b = opener(SECRET)
    assert read(b, keys[1])[0] is False
    assert b.stats()["misses_unauthenticated"] == 1
    b = opener(None)  # the other way: a reader without a key checks the checksums only
    assert read(b, keys[0]) == (True, make_page(3, PAGE))


def test_a_storage_key_is_never_shown_and_must_be_long_enough() -> None:
    mac = RecordMac(SECRET)
    assert SECRET.decode() not in repr(mac) and SECRET.decode() not in str(vars(type(mac)))
    with pytest.raises(ValueError, match=f"at least {MIN_KEY_BYTES} bytes"):
        RecordMac(b"short")


def test_the_storage_key_setting_from_the_environment_or_a_file_never_shown(tmp_path: Path) -> None:
    env = {"TPCACHE_STORAGE_KEY": SECRET.decode()}
    assert resolve(cli={}, env=env).config.storage_secret() == SECRET
    path = tmp_path / "storage.key"
    path.write_text(SECRET.decode() + "\n")
    assert resolve(cli={"storage_key_file": str(path)}, env={}).config.storage_secret() == SECRET
    assert resolve(cli={}, env={}).config.storage_secret() is None
    with pytest.raises(ConfigError) as info:
        resolve(cli={}, env={"TPCACHE_STORAGE_KEY": "too-short"})
    assert "TPCACHE_STORAGE_KEY=***: the storage key must be at least 16 bytes" in str(info.value)
    assert "too-short" not in str(info.value)
    with pytest.raises(ConfigError, match="--storage-key-file .*missing: cannot be read: No such file or directory$"):
        resolve(cli={"storage_key_file": str(tmp_path / "missing")}, env={})
    with pytest.raises(ConfigError, match="give storage_key or storage_key_file, not both"):
        resolve(cli={"storage_key_file": str(path)}, env=env)
