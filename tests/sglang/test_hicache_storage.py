"""tpcache's storage as SGLang HiCache's L3 tier, with real SGLang 0.5.23 engines on CPU.

TP=2, file store: one engine serves three prompts and writes their pages through to a tpcache
file store (one shard per TP rank). A page's record on rank 1 is then damaged. A fresh engine on
the same store serves the same prompts: the untouched prompts come whole from storage, the
damaged one only up to the damaged page (rank 1's miss is the group's miss), and every prompt's
tokens are the ones the first engine computed without any cache.

TP=1, Redis store: one engine serves the prompts, empties its device and host tiers, and serves
them again from the store, with the same tokens.

Runs in SGLang's own venv (``make setup-sglang``); the main venv has no SGLang and skips this
module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed here: the SGLang ring runs in .venv-sglang (make setup-sglang)",
        allow_module_level=True,
    )

import xxhash

from tests.sglang.engines import run_engine
from tpcache.io.storage.keys import StorageKey
from tpcache.io.storage.record import HEADER_SIZE, decode_header, read_key_echo
from tpcache.testing.servers import RedisServer
from tpcache.testing.tiny_model import make_tiny_llama

PAGE = 16
TP = 2
DAMAGED_PROMPT, DAMAGED_PAGE, DAMAGED_RANK = 1, 2, 1


def _prompts() -> list[list[int]]:
    # Three prompts of 70 tokens that share no first page: 4 full pages each (SGLang matches at
    # most all but the last token, so 64 tokens can come from the cache).
    return [[(7 * i + 13 * j) % 500 + 3 for j in range(70)] for i in range(1, 4)]


def damage_record(store: Path, rank: int, sglang_key: str) -> int:
    """Flip a byte in the payload of the first record of ``sglang_key``'s page on ``rank``; returns
    how many of the page's records were found (one per piece the host pool keeps a page in)."""
    wanted = {xxhash.xxh3_64_intdigest(f"{sglang_key}#{piece}".encode()): piece for piece in range(64)}
    found = 0
    for seg in sorted((store / f"rank{rank}").rglob("*.seg")):
        data = bytearray(seg.read_bytes())
        offset = 0
        while offset + HEADER_SIZE <= len(data):
            head = decode_header(bytes(data[offset : offset + HEADER_SIZE + 1024]), None)
            key = StorageKey.decode(read_key_echo(data[offset:], head).decode())
            if key.page_hash in wanted:
                found += 1
                if wanted[key.page_hash] == 0:
                    data[offset + head.record_len - 1] ^= 0xFF
                    seg.write_bytes(bytes(data))
            offset += head.record_len
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("sglang_model")))


def _spec(model: Path, tp: int, storage_url: str, **more) -> dict:
    return {
        "model": str(model),
        "tp": tp,
        "page_size": PAGE,
        "storage_url": storage_url,
        "prompts": _prompts(),
        "max_new_tokens": 8,
        **more,
    }


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict:
    workdir = Path(tmp_path_factory.mktemp("sglang_hicache"))
    store = workdir / "store"
    spec = _spec(model, TP, f"file://{store}")
    (first,) = run_engine(workdir, "write", spec)["passes"]

    from sglang.srt.mem_cache.utils import get_storage_hash_str

    page_keys = get_storage_hash_str(_prompts()[DAMAGED_PROMPT], None, page_size=PAGE)
    pieces = damage_record(store, DAMAGED_RANK, page_keys[DAMAGED_PAGE])
    (second,) = run_engine(workdir, "read", spec)["passes"]
    return {"first": first, "second": second, "pieces": pieces}


def test_fresh_engine_reads_the_store_and_computes_the_same_tokens(ring: dict) -> None:
    first, second = ring["first"], ring["second"]
    # The first engine started cold: nothing of any prompt came from storage.
    assert [c["storage"] for c in first["cached"]] == [0, 0, 0]
    assert second["outputs"] == first["outputs"]
    intact = [i for i in range(3) if i != DAMAGED_PROMPT]
    assert [second["cached"][i]["storage"] for i in intact] == [64, 64]


def test_a_damaged_record_on_one_rank_is_a_miss_for_the_group(ring: dict) -> None:
    # The damaged page's records were found (one per layer for K and for V), so the test did
    # damage what the engine wrote.
    assert ring["pieces"] == 4
    second = ring["second"]
    assert second["cached"][DAMAGED_PROMPT]["storage"] == DAMAGED_PAGE * PAGE
    assert second["outputs"][DAMAGED_PROMPT] == ring["first"]["outputs"][DAMAGED_PROMPT]


@pytest.fixture(scope="module")
def redis_ring(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict:
    workdir = Path(tmp_path_factory.mktemp("sglang_redis"))
    with RedisServer(workdir / "redis") as server:
        return run_engine(workdir, "redis", _spec(model, 1, server.url, second_pass=True))


def test_redis_store_serves_the_prompts_after_sglang_empties_its_tiers(redis_ring: dict) -> None:
    first, second = redis_ring["passes"]
    assert [c["storage"] for c in first["cached"]] == [0, 0, 0]
    assert [c["storage"] for c in second["cached"]] == [64, 64, 64]
    assert second["outputs"] == first["outputs"]
