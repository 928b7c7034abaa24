"""The settings of tpcache's HiCache storage backend: each mistake a user can make stops the engine
at start with one line naming the setting. Runs in SGLang's venv (``make setup-sglang``)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed here: the SGLang ring runs in .venv-sglang (make setup-sglang)",
        allow_module_level=True,
    )

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from tpcache.integrations.sglang.storage import TPCacheHiCacheStorage

BASE = {
    "backend_name": "tpcache",
    "module_path": "tpcache.integrations.sglang.storage",
    "class_name": "TPCacheHiCacheStorage",
    "interface_v1": 1,
}


def config(extra: dict, tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="/models/tiny llama",
        extra_config=extra,
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {k: v for k, v in BASE.items() if k != "interface_v1"} | {"storage_url": "file:///tmp/x"},
            '"interface_v1": 1',
        ),
        (BASE, '"storage_url"'),
        (BASE | {"storage_url": "s3://bucket"}, "unknown storage URL scheme 's3'"),
        (BASE | {"storage_url": "file:///tmp/x?fsynk=always"}, "no setting 'fsynk'"),
        (BASE | {"storage_url": "file:///tmp/x", "capacity": "lots"}, "'lots' is not a size"),
        (BASE | {"storage_url": "file:///tmp/x", "storage_path": "/tmp"}, "no setting 'storage_path'"),
    ],
)
def test_a_wrong_setting_is_one_line_naming_it(extra: dict, says: str) -> None:
    with pytest.raises(ValueError) as info:
        TPCacheHiCacheStorage(config(extra), {})
    message = str(info.value)
    assert says in message
    assert "\n" not in message


def test_each_rank_opens_its_own_shard_of_the_store(tmp_path) -> None:
    extra = BASE | {"storage_url": f"file://{tmp_path}"}
    backends = [TPCacheHiCacheStorage(config(extra, rank, 2), {}) for rank in range(2)]
    try:
        assert [tuple(b.shard)[:2] for b in backends] == [(0, 2), (1, 2)]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
        # The model path becomes a namespace made of safe characters only.
        assert backends[0].namespace == "models-tiny-llama"
    finally:
        for b in backends:
            b.close()


def test_a_model_with_more_than_full_attention_kv_is_refused_at_start(tmp_path) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend = TPCacheHiCacheStorage(config(BASE | {"storage_url": f"file://{tmp_path}"}), {})
    try:
        backend.register_mem_host_pool_v2(object(), PoolName.KV)  # the full-attention pool is served
        for name in (PoolName.SWA, PoolName.MAMBA, PoolName.DRAFT):
            with pytest.raises(ValueError, match=f"keeps '{name.value}' pages in HiCache"):
                backend.register_mem_host_pool_v2(object(), name)
    finally:
        backend.close()
