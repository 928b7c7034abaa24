"""vLLM's KV cache groups seen by the connector (vLLM's own spec classes, no engine): one tpcache
page holds one block of every group; a sliding-window group's null block is a page it no longer
holds, never read and never written; a Mamba group's state block is a page's only at the boundary
where its step ended (a flag in the page says so, and a hit ends at a page that carries its state);
layers tpcache cannot serve are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from tpcache.core.external import NOT_HELD
from tpcache.integrations.vllm.connector import kv_groups
from tpcache.integrations.vllm.layout import NULL_BLOCK, engine_kv_from_vllm, leading_unheld, page_ids

BLOCKS, PAGE = 6, 4


def specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=2, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=PAGE, num_kv_heads=1, head_size=2, dtype=torch.float32, sliding_window=8)
    mamba = MambaSpec(block_size=PAGE, shapes=((2, 2),), dtypes=(torch.float32,))
    return full, swa, mamba


def config(*group_specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer{g}"], spec) for g, spec in enumerate(group_specs)]
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def test_full_attention_sliding_window_and_mamba_groups_are_served_and_others_refused_with_the_reason() -> None:
    import dataclasses

    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    full, swa, mamba = specs()
    assert kv_groups(config(full, swa), PAGE) == [(["layer0"], False, False), (["layer1"], True, False)]
    # a Mamba group's block holds a request's whole state, whatever its block size
    long_mamba = dataclasses.replace(mamba, block_size=64 * PAGE)
    assert kv_groups(config(long_mamba, full), PAGE) == [(["layer0"], False, True), (["layer1"], False, False)]
    with pytest.raises(ValueError, match=r"prefix caching off .* use mamba_cache_mode 'align'$") as err:
        kv_groups(config(full, dataclasses.replace(mamba, mamba_cache_mode="align")), PAGE)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'none' and 1 speculative blocks"):
        kv_groups(config(full, dataclasses.replace(mamba, num_speculative_blocks=1)), PAGE)
    with pytest.raises(ValueError, match="Mamba layers only"):
        kv_groups(config(long_mamba), PAGE)
    chunked = ChunkedLocalAttentionSpec(
        block_size=PAGE, num_kv_heads=1, head_size=2, dtype=torch.float32, attention_chunk_size=8
    )
    with pytest.raises(ValueError, match=r"layers \['layer1'\] use ChunkedLocalAttentionSpec"):
        kv_groups(config(full, chunked), PAGE)
    with pytest.raises(ValueError, match="one block size for every KV cache group"):
        kv_groups(config(full, swa), 2 * PAGE)


def two_groups() -> tuple[dict[str, torch.Tensor], object]:
    # one tensor per layer: [blocks, PAGE, 2] (K and V side by side), a value per block and layer
    kv = {f"layer{g}": torch.zeros(BLOCKS, PAGE, 2) for g in range(2)}
    adapter, layout, _ = engine_kv_from_vllm(kv, BLOCKS, PAGE, {"layer0": 0, "layer1": 1}, [False, True])
    return kv, (adapter, layout)


def test_a_page_is_one_block_of_every_group_and_a_freed_window_block_is_never_read_or_written() -> None:
    kv, (adapter, layout) = two_groups()
    for b in range(BLOCKS):
        kv["layer0"][b] = 10 + b
        kv["layer1"][b] = 20 + b
    # page 0: full block 1, window block freed (null); page 1: full block 2, window block 3
    blocks = [[1, 2], [NULL_BLOCK, 3]]
    assert page_ids(adapter, blocks, save=True) == [NOT_HELD, adapter.page_id([2, 3])]
    assert leading_unheld(adapter, blocks) == 0 and leading_unheld(adapter, [[0, 0, 4], [0, 0, 4]]) == 0
    host = torch.zeros(4, adapter.page_elems)
    adapter.save(host, [adapter.page_id([2, 3])], [0])
    assert host[0, : PAGE * 2].eq(12).all() and host[0, PAGE * 2 :].eq(23).all()
    # a load of both pages: the null block (block 0) keeps its bytes, the others get the page's
    ids = page_ids(adapter, [[4, 5], [NULL_BLOCK, 1]], save=False)
    host[1] = host[0]
    adapter.load(host, [0, 1], ids)
    assert kv["layer1"][NULL_BLOCK].eq(20).all()
    assert kv["layer0"][4].eq(12).all() and kv["layer0"][5].eq(12).all() and kv["layer1"][1].eq(23).all()


def test_a_hit_of_a_model_whose_every_group_is_windowed_skips_the_pages_before_the_window() -> None:
    kv = {"layer0": torch.zeros(BLOCKS, PAGE, 2)}
    adapter, _, _ = engine_kv_from_vllm(kv, BLOCKS, PAGE, {"layer0": 0}, [True])
    assert leading_unheld(adapter, [[NULL_BLOCK, NULL_BLOCK, 4, 5]]) == 2
    assert page_ids(adapter, [[4, 5]], save=False) == [4, 5]  # one group: a page is its block id


def test_the_scheduler_names_every_groups_blocks_and_a_failed_hybrid_load_is_not_offered_again() -> None:
    from tests.unit.test_vllm_connector_parts import Req, output
    from tpcache.integrations.vllm.messages import LOAD, RELEASE, SAVE, WorkerReport
    from tpcache.integrations.vllm.scheduler import SchedulerSide

    r = Req("a", list(range(13)), blocks=[10, 11, 12, 13])
    window = [NULL_BLOCK, 21, 22, 23]  # the window group freed page 0's block

    class Manager:
        def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
            return (r.blocks, window)

    side = SchedulerSide(PAGE, Manager())
    side.num_new_matched_tokens(r, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={"a": (12, 0)}), None)
    assert side.num_new_matched_tokens(r, 0) == (12, True)
    side.update_state_after_alloc(r, (r.blocks, window), 12)
    assert side.build_meta(output()).ops == [(LOAD, "a", 0, [[10, 11, 12], [NULL_BLOCK, 21, 22]])]
    side.update_from_output(None, {"a"}, None, {"a"})  # the load failed on some rank
    assert side.requests["a"].hit == 0 and side.requests["a"].load_failed
    r.num_computed_tokens = 12
    assert side.request_finished(r, (r.blocks, window)) is True
    ops = side.build_meta(output()).ops
    assert ops == [(SAVE, "a", [], 3, [[10, 11, 12], [NULL_BLOCK, 21, 22]]), (RELEASE, "a", True)]


def test_a_worker_saves_up_to_a_freed_window_block_and_reports_a_failed_hybrid_load_by_request() -> None:
    from tpcache.comm import SimGroup
    from tpcache.core import CacheConfig
    from tpcache.engine.external import EngineCache
    from tpcache.integrations.vllm.faults import FaultPlan
    from tpcache.integrations.vllm.messages import LOAD, LOOKUP, SAVE, StepOps
    from tpcache.integrations.vllm.worker import WorkerSide

    kv = {f"layer{g}": torch.randn(BLOCKS, PAGE, 2) for g in range(2)}
    adapter, layout, fmt = engine_kv_from_vllm(kv, BLOCKS, PAGE, {"layer0": 0, "layer1": 1}, [False, True])
    faults = FaultPlan({"fail_loads": {"rank": 0, "count": 1}}, 0)
    config = CacheConfig(page_size=PAGE, device_pages=0, host_pages=8)
    cache = EngineCache(
        config, SimGroup(1).collective(0), adapter, layout, engine_format=fmt, before_copy=faults.before_copy
    )
    worker = WorkerSide(cache, faults=faults)
    tokens = list(range(3 * PAGE))
    # pages 0-1 held by both groups, page 2's window block already freed: two pages are saved
    worker.run_step(StepOps(0, [(LOOKUP, "a", tokens), (SAVE, "a", [], 3, [[1, 2, 3], [4, 5, NULL_BLOCK]])]))
    worker.run_step(StepOps(1, []))
    assert cache.match(tokens).host_pages == 2
    result = worker.run_step(StepOps(2, [(LOOKUP, "b", tokens + [7])]))
    assert result.report.hits["b"] == (2 * PAGE, 0)
    result = worker.run_step(StepOps(3, [(LOAD, "b", 0, [[1, 2], [4, 5]])]))  # the injected failure
    assert result.finished_recving == {"b"} and result.failed_recving == {"b"} and not result.invalid_blocks
    cache.close()


def test_more_groups_and_blocks_than_a_63_bit_page_id_names_are_refused_in_one_line() -> None:
    from tpcache.io.engine_kv import EngineKV
    from tpcache.io.errors import KVLayoutError

    blocks = 1 << 16  # four groups of 2**16 blocks: page ids up to 2**64
    parts = [torch.zeros(blocks, 1) for _ in range(4)]
    assert EngineKV(parts[:3], groups=[0, 1, 2]).num_groups == 3  # 2**48 ids: served
    with pytest.raises(KVLayoutError, match="4 KV cache groups of 65536 blocks") as err:
        EngineKV(parts, groups=[0, 1, 2, 3])
    assert "\n" not in str(err.value)


def mamba_model() -> tuple[dict[str, torch.Tensor], object]:
    """An attention layer (group 1, [blocks, PAGE, 2] float32) and a Mamba layer (group 0, a state
    block of 5 float32 values), vLLM's groups in that order."""
    kv = {"mixer": torch.zeros(BLOCKS, 5), "attn": torch.zeros(BLOCKS, PAGE, 2)}
    adapter, layout, fmt = engine_kv_from_vllm(kv, BLOCKS, PAGE, {"mixer": 0, "attn": 1}, [False, False], [True, False])
    return kv, (adapter, layout, fmt)


def test_a_page_carries_a_mamba_state_only_where_its_block_is_named_and_a_load_never_writes_the_null_block() -> None:
    kv, (adapter, layout, fmt) = mamba_model()
    assert adapter.states == {0} and adapter.state_flag_part is not None
    assert layout.page_bytes == adapter.page_bytes and adapter.page_bytes >= 4 * (5 + 2 * PAGE) + 1
    assert "float32" in fmt and "state_flag" in fmt
    for b in range(BLOCKS):
        kv["mixer"][b] = 100 + b
        kv["attn"][b] = 10 + b
    host = torch.zeros(4, adapter.page_elems, dtype=torch.uint8)
    # page 0: attention block 1, no state (the null block); page 1: attention block 2, state block 3
    pages = page_ids(adapter, [[NULL_BLOCK, 3], [1, 2]], save=True)
    adapter.save(host, pages, [0, 1])
    assert adapter.state_flags(host, [0, 1]) == [False, True]
    # a hit of both pages loads the state of its last page only: block 0 keeps its bytes
    kv["mixer"].zero_()
    kv["attn"].zero_()
    adapter.load(host, [0, 1], page_ids(adapter, [[NULL_BLOCK, 4], [5, 1]], save=False))
    assert kv["mixer"][NULL_BLOCK].eq(0).all() and kv["mixer"][4].eq(103).all()
    assert kv["attn"][5].eq(11).all() and kv["attn"][1].eq(12).all()
    assert kv["mixer"][1:4].eq(0).all() and kv["mixer"][5].eq(0).all()


def test_a_mamba_layer_handed_over_as_one_tensor_per_state_is_one_layer_of_the_page() -> None:
    conv, ssm = torch.zeros(BLOCKS, 3, 2, dtype=torch.bfloat16), torch.zeros(BLOCKS, 2, 2)
    kv = {"mixer": [conv, ssm], "attn": torch.zeros(BLOCKS, PAGE, 2)}
    adapter, layout, _ = engine_kv_from_vllm(kv, BLOCKS, PAGE, {"mixer": 0, "attn": 1}, [False, False], [True, False])
    assert adapter.num_layers == layout.num_layers == 2  # conv and SSM: both the mixer's layer 0
    assert adapter.part_layers == [0, 0, 1, 1] and adapter.groups == [0, 0, 1, 0]  # the flags go with layer 1
    conv[2], ssm[2] = 1.5, -2.0
    host = torch.zeros(2, adapter.page_elems, dtype=torch.uint8)
    adapter.save(host, page_ids(adapter, [[2], [3]], save=True), [0])
    conv.zero_(), ssm.zero_()
    adapter.load(host, [0], page_ids(adapter, [[4], [5]], save=False))
    assert conv[4].eq(1.5).all() and ssm[4].eq(-2.0).all() and adapter.state_flags(host, [0]) == [True]


def test_the_scheduler_names_a_mamba_state_at_the_boundary_its_step_ends_on_and_loads_it_at_the_hits_end() -> None:
    from tests.unit.test_vllm_connector_parts import Req, output
    from tpcache.integrations.vllm.messages import LOAD, RELEASE, SAVE, WorkerReport
    from tpcache.integrations.vllm.scheduler import SchedulerSide

    r = Req("a", list(range(13)), blocks=[10, 11, 12, 13])
    state = [7]  # the request's one state block (group 0)

    class Manager:
        def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
            return (state, r.blocks)

    side = SchedulerSide(PAGE, Manager(), state_groups=[0])
    side.num_new_matched_tokens(r, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={"a": (0, 0)}), None)
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    # a chunk of 6 tokens: page 0 is full, its boundary is not where the step ends: no state
    ops = side.build_meta(output(a=6)).ops
    assert ops == [(SAVE, "a", [], 1, [[NULL_BLOCK], [10]])]
    r.num_computed_tokens = 6
    # the next chunk ends at 12: page 2's state is the block's after the step
    ops = side.build_meta(output(a=6)).ops
    assert ops == [(SAVE, "a", [], 3, [[NULL_BLOCK, NULL_BLOCK, 7], [10, 11, 12]])]
    r.num_computed_tokens = 12
    assert side.request_finished(r, (state, r.blocks)) is True
    assert side.build_meta(output()).ops == [(RELEASE, "a", True)]
    # another request's hit of 2 pages: the state block goes to its last page
    b = Req("b", list(range(13)), blocks=[20, 21, 22, 23])
    side.num_new_matched_tokens(b, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={"b": (8, 0)}), None)
    assert side.num_new_matched_tokens(b, 0) == (8, True)
    side.update_state_after_alloc(b, ([9], b.blocks), 8)
    assert side.build_meta(output()).ops == [(LOAD, "b", 0, [[NULL_BLOCK, 9], [20, 21]])]
    # a hit past the last page before the last token: the state held is the hit's end's, none shorter
    c = Req("c", list(range(13)), blocks=[30, 31, 32, 33])
    side.num_new_matched_tokens(c, 0)
    side.build_meta(output())
    side.update_from_output(WorkerReport(hits={"c": (16, 0)}), None)
    assert side.num_new_matched_tokens(c, 0) == (0, False)


def test_a_workers_hit_ends_at_the_last_page_that_carries_its_mamba_state_before_the_last_token() -> None:
    from tpcache.comm import SimGroup
    from tpcache.core import CacheConfig
    from tpcache.engine.external import EngineCache
    from tpcache.integrations.vllm.messages import LOAD, LOOKUP, SAVE, StepOps
    from tpcache.integrations.vllm.worker import WorkerSide

    kv, (adapter, layout, fmt) = mamba_model()
    kv["mixer"][3] = 42.0
    config = CacheConfig(page_size=PAGE, device_pages=0, host_pages=8)
    cache = EngineCache(config, SimGroup(1).collective(0), adapter, layout, engine_format=fmt)
    worker = WorkerSide(cache)
    tokens = list(range(4 * PAGE))
    # four pages saved; states at pages 1 and 3 (0-based), none at 0 and 2
    save = (SAVE, "a", [], 4, [[NULL_BLOCK, 3, NULL_BLOCK, 3], [1, 2, 4, 5]])
    worker.run_step(StepOps(0, [(LOOKUP, "a", tokens), save]))
    worker.run_step(StepOps(1, []))
    assert cache.match(tokens).host_pages == 4
    hits = {}
    for name, n in (("whole", 4 * PAGE + 1), ("three", 3 * PAGE + 1), ("last", 4 * PAGE), ("one", PAGE + 1)):
        result = worker.run_step(StepOps(2, [(LOOKUP, name, tokens[:n] + [999] * (n > 4 * PAGE))]))
        hits[name] = result.report.hits[name][0] // PAGE
    # 4 pages and a token: page 3's state; 3 pages and a token: back to page 1's; the 4 pages
    # alone: vLLM computes the last token, so at most 3 pages, whose state is page 1's; one page: none
    assert hits == {"whole": 4, "three": 2, "last": 2, "one": 0}
    kv["mixer"].zero_()
    worker.run_step(StepOps(3, [(LOAD, "three", 0, [[NULL_BLOCK, 4], [1, 2]])]))
    assert kv["mixer"][4].eq(42.0).all() and kv["mixer"][NULL_BLOCK].eq(0).all()
    cache.close()
