"""Storage URLs: parsing, the service's storage_url option (and storage_dir as file://), and a
2-rank service writing through to a real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service.checks import cache_round_trip
from tests.service.harness import running_service, wait_for
from tpcache.io.storage import FileBackend, StorageURLError, open_storage, parse_storage_url
from tpcache.service.config import ConfigError, build_config

LAYOUT = "L2xH1xD8:fp32"


def test_urls_name_a_backend_its_place_and_typed_settings() -> None:
    f = parse_storage_url("file:///mnt/kv%20cache?fsync=never&capacity=2GiB")
    assert (f.backend, f.location, f.settings) == ("file", "/mnt/kv cache", {"fsync": "never", "capacity": 2 << 30})
    m = parse_storage_url("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&staging=32MiB")
    assert (m.backend, m.location) == ("mooncake", "10.0.0.5:50051")
    assert m.settings == {"metadata": "http://10.0.0.5:8080/metadata", "staging": 32 << 20}
    r = parse_storage_url("redis://:s3cret@cache.internal:6380/3?timeout=2&prefix=team-a/")
    assert (r.backend, r.location) == ("redis", "redis://:s3cret@cache.internal:6380/3")
    assert r.settings == {"timeout": 2.0, "prefix": "team-a/"}
    assert "s3cret" not in r.describe() and "cache.internal:6380/3" in r.describe()
    assert parse_storage_url("valkey://h:1").location == "redis://h:1/0"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("/mnt/kv", "must look like"),
        ("file://relative/dir", "absolute path"),
        ("mooncake://10.0.0.5:50051", "metadata"),
        ("mooncake://10.0.0.5?metadata=http://x/metadata", "HOST:PORT"),
        ("redis://h:1/0?timout=3", "no setting 'timout'"),
        ("redis://h:1/zero", "must be a number"),
        ("mooncake://h:1?metadata=m&staging=lots", "not a size"),
        ("s3://bucket/kv", "unknown storage URL scheme"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, match: str) -> None:
    with pytest.raises(StorageURLError, match=match):
        parse_storage_url(url)


def test_file_urls_keep_the_storage_dir_layout(tmp_path: Path) -> None:
    with open_storage(f"file://{tmp_path}?capacity=64MiB", shard=(1, 2)) as b:
        assert isinstance(b, FileBackend) and b.stats()["capacity_bytes"] == 64 << 20
    assert (tmp_path / "rank1" / "r1of2" / "LOCK").exists()


def test_service_config_takes_a_url_and_storage_dir_as_file_url(tmp_path: Path) -> None:
    c = build_config(env={}, cli={"storage_dir": str(tmp_path), "kv_layout": LAYOUT, "host_pages": 8})
    assert c.storage_location() == f"file://{tmp_path}" and c.cache_config().storage
    env = {"TPCACHE_STORAGE_URL": "redis://127.0.0.1:6379/0", "TPCACHE_KV_LAYOUT": LAYOUT, "TPCACHE_HOST_PAGES": "8"}
    c = build_config(env=env)
    assert c.storage_location() == "redis://127.0.0.1:6379/0" and c.cache_config().storage
    with pytest.raises(ConfigError, match="not both"):
        build_config(env={}, cli={"storage_dir": "/x", "storage_url": "file:///y", "kv_layout": LAYOUT})
    with pytest.raises(ConfigError, match="--storage-url .*no setting"):
        build_config(env={}, cli={"storage_url": "redis://h:1/0?nope=1", "kv_layout": LAYOUT})
    with pytest.raises(ConfigError, match="needs kv_layout"):
        build_config(env={}, cli={"storage_url": "redis://h:1/0"})
    with pytest.raises(ConfigError, match=r"^host_pages = 0 \(default\): must be > 0 with a storage tier"):
        build_config(env={}, cli={"storage_dir": str(tmp_path), "kv_layout": LAYOUT})


@pytest.mark.multiprocess
@pytest.mark.xdist_group("store")
def test_a_service_writes_through_to_a_redis_store(redis_server, tmp_path: Path) -> None:
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    args = ["--kv-layout", LAYOUT, "--host-pages", "64", "--namespace", "svc-test", "--storage-url", redis_server.url]
    with running_service(tmp_path, *args) as service:
        assert f"storage tier: Redis-protocol store at redis://127.0.0.1:{redis_server.port}/0" in service.log()
        cache_round_trip(service, pages=3)
        # Each rank's shard of each page lands under its own key, as a checksummed record.
        keys = wait_for(lambda: sorted(raw.keys("tpcache/v1/n_svc-test/*")), timeout_s=30)
        assert len(keys) == 6, keys
        assert {k.decode().split("/")[4] for k in keys} == {"0of2", "1of2"}
    raw.close()
