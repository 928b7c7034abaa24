"""vLLM's KV cache groups seen by the connector (vLLM's own spec classes, no engine): one tpcache
page holds one block of every group; a sliding-window group's null block is a page it no longer
holds, never read and never written; layers tpcache cannot serve are refused with the reason."""

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


def test_full_attention_and_sliding_window_groups_are_served_and_mamba_is_refused_with_the_reason() -> None:
    full, swa, mamba = specs()
    assert kv_groups(config(full, swa), PAGE) == [(["layer0"], False), (["layer1"], True)]
    with pytest.raises(ValueError, match=r"layers \['layer1'\] use MambaSpec"):
        kv_groups(config(full, mamba), PAGE)
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
