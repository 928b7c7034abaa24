"""tpcache's tiers in vLLM's KV events: the worker's collector reads a real core's rounds, and the
scheduler side reports them under vLLM's block hashes, bounded and counted (the engines' ring
decodes the same from a running vLLM, tests/vllm/test_vllm.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tpcache.core import CacheConfig, CacheCore
from tpcache.core.hashing import as_token_bytes, hash_chain
from tpcache.replay import drain

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from tpcache.integrations.vllm.events import BlockEvents, collect_changes  # noqa: E402
from tpcache.integrations.vllm.messages import LOOKUP, SAVE  # noqa: E402

P = 4
NS = "ns|vllm|model"


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    salt: int = 0  # stands for what changes vLLM's block hash and not the tokens (a cache_salt)
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.all_token_ids) // P
        self.block_hashes = [bytes([self.salt, i]) + bytes(30) for i in range(n)]


def hashes(req: Req) -> list[int]:
    return hash_chain(as_token_bytes(req.all_token_ids), P, NS)


def vllm(*blocks: bytes) -> list[object]:
    return [maybe_convert_block_hash(b) for b in blocks]


def by_medium(events: list[object]) -> dict[tuple[str, str], list[object]]:
    out: dict[tuple[str, str], list[object]] = {}
    for ev in events:
        assert not isinstance(ev, AllBlocksCleared)  # that one would clear vLLM's own blocks too
        out.setdefault((type(ev).__name__, ev.medium), []).extend(ev.block_hashes)
    return out


def test_the_collector_hands_over_what_each_round_of_a_core_changed_on_host_and_storage() -> None:
    class Cache:  # what collect_changes needs of an EngineCache: its core and its per-round hook
        core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
        events = None

    cache = Cache()
    collector = collect_changes(cache)
    tokens = list(range(3 * P))
    lease, _ = cache.core.lock(tokens)
    cache.core.insert(lease, tokens, cache.core.alloc(lease, 3))
    cache.core.release(lease)
    drain(cache.core)
    cache.events.after_round(cache.core)
    changes = collector.take()
    stored_host = [h for c in changes for h in c[3]]
    assert stored_host == hash_chain(as_token_bytes(tokens), P, "")  # backed up to host, in order
    assert collector.take() == []


def test_pages_are_reported_under_vllms_block_hashes_with_vllms_mediums() -> None:
    ev = BlockEvents(P, NS)
    a, b = Req("a", list(range(3 * P + 1))), Req("b", list(range(2 * P)), salt=7)  # b: a's first pages
    ev.track(a)
    ev.track(b)
    ev.saw([(LOOKUP, "a", a.all_token_ids), (SAVE, "b", [], 2, [0, 1])])
    ha = hashes(a)
    ev.reported([(False, [], [], ha, ha[:1])])
    got = by_medium(ev.take())
    # a's pages on the host tier; the first two also b's blocks (the same tokens, another vLLM hash)
    assert got[("BlockStored", "CPU")] == vllm(
        a.block_hashes[0], b.block_hashes[0], a.block_hashes[1], b.block_hashes[1], a.block_hashes[2]
    )
    assert got[("BlockStored", "STORAGE")] == vllm(a.block_hashes[0], b.block_hashes[0])
    ev.reported([(False, ha[2:], [], [], [])])
    assert by_medium(ev.take()) == {("BlockRemoved", "CPU"): vllm(a.block_hashes[2])}
    # a flush: every page the stream said was on a tier is removed from it
    ev.reported([(True, [], [], [], [])])
    got = by_medium(ev.take())
    assert sorted(got[("BlockRemoved", "CPU")]) == sorted(vllm(*a.block_hashes[:2], *b.block_hashes[:2]))
    assert sorted(got[("BlockRemoved", "STORAGE")]) == sorted(vllm(a.block_hashes[0], b.block_hashes[0]))
    assert ev.counters["pages_unmapped"] == 0
    assert all(isinstance(e, (BlockStored, BlockRemoved)) for e in ev.take()) and not ev.take()


def test_the_map_is_bounded_and_what_it_forgot_is_counted_not_reported() -> None:
    ev = BlockEvents(P, NS, max_pages=2)
    a = Req("a", list(range(3 * P)))
    ev.track(a)
    ev.saw([(LOOKUP, "a", a.all_token_ids)])
    assert ev.counters == {"pages_mapped": 3, "pages_forgotten": 1, "pages_unmapped": 0}
    ha = hashes(a)
    ev.reported([(False, [], [], ha, [])])  # the first page is no longer mapped
    assert by_medium(ev.take()) == {("BlockStored", "CPU"): vllm(*a.block_hashes[1:])}
    assert ev.counters["pages_unmapped"] == 1
    ev.finished(a)
    assert not ev.requests  # a finished request is no longer held
