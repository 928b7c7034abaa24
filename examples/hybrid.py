"""A hybrid model in an engine's TP workers: full-attention pages, sliding-window pages and Mamba
states, each in its own pools, agreed like every other page.

    torchrun --nproc-per-node 2 examples/hybrid.py

docs/guides/hybrid.md shows this file from the first import on (tests/launcher/test_examples.py checks that
they are the same and runs it).
"""

import torch.distributed as dist

from tpcache.comm import make_collective
from tpcache.core import CacheConfig
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout, state_layout

dist.init_process_group("gloo")  # the engine's TP group; torchrun sets RANK and WORLD_SIZE
tp = dist.get_world_size()
full = KVLayout.from_model(num_layers=4, num_kv_heads=8, head_dim=128, tp_size=tp, page_size=16)  # full layers
swa = KVLayout.from_model(num_layers=8, num_kv_heads=8, head_dim=128, tp_size=tp, page_size=16)  # window layers
state = state_layout(num_layers=4, bytes_per_layer=65536)  # each Mamba layer's conv + SSM state on this rank
cache = TPCache(
    CacheConfig(
        page_size=16,
        device_pages=128,
        host_pages=512,
        swa_window=128,  # tokens: a hit needs the 8 SWA pages before its boundary
        swa_device_pages=64,
        swa_host_pages=512,
        mamba_every=4,  # a state every 4 pages: a hit ends at one
        mamba_state_bytes=state.page_bytes,
        mamba_device_states=32,
        mamba_host_states=256,
    ),
    make_collective("auto"),
    kv_layout=full,
    part_layouts={"swa": swa, "mamba": state},
)

prompt = list(range(1000))  # 62 full pages
for turn in range(2):
    lease, hit = cache.lock(prompt)  # the longest prefix the hit rule allows; hit.parts: what it reads
    loaded = cache.load(lease)  # full pages, the window's SWA pages and the state, back from host
    loaded.wait()  # (or wait_layer(i) before layer i)
    have = len(loaded.device_pages)
    start = have * 16
    n = cache.chunk_tokens(lease, start, len(prompt) - start)  # what the pools take now (0: wait)
    pages = (start + n) // 16
    fresh = cache.alloc(lease, pages - have)
    states = [i for i in range(have, pages) if (i + 1) % 4 == 0]  # the boundaries a state is kept at
    swa_slots, state_slots = cache.alloc(lease, pages - have, "swa"), cache.alloc(lease, len(states), "mamba")
    # ... the forward pass writes the new tokens' KV (full and window layers) and the states ...
    state_row = [-1] * pages
    for i, slot in zip(states, state_slots, strict=True):
        state_row[i] = slot
    parts = {"swa": [-1] * have + swa_slots, "mamba": state_row}
    cache.insert(lease, prompt[: pages * 16], loaded.device_pages + fresh, parts)
    cache.release(lease)  # its SWA behind the window (not a later hit's) was already let go
    cache.step()
    print(f"rank {dist.get_rank()} turn {turn}: {hit.device_pages + hit.host_pages} of {hit.num_pages} pages hit")
cache.close()
dist.destroy_process_group()
