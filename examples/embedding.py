"""Embedding tpcache in an engine's TP workers: each worker owns one cache rank.

    torchrun --nproc-per-node 2 examples/embedding.py

docs/guides/embedding.md shows this file from the first import on (tests/launcher/test_examples.py checks that
they are the same and runs it).
"""

import torch.distributed as dist

from tpcache.comm import make_collective
from tpcache.core import CacheConfig
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout

dist.init_process_group("gloo")  # the engine's TP group (NCCL on GPUs); torchrun sets RANK and WORLD_SIZE
layout = KVLayout.from_model(  # Llama-3-8B's KV shape: 1 MiB a page on each of 2 ranks
    num_layers=32, num_kv_heads=8, head_dim=128, tp_size=dist.get_world_size(), dtype="bfloat16", page_size=16
)
cache = TPCache(
    CacheConfig(page_size=16, device_pages=64, host_pages=256, write_policy="write_through"),  # 320 MiB a rank
    make_collective("auto"),  # shared memory when all ranks share a host, else gloo/NCCL
    kv_layout=layout,
)  # or device_pool=DevicePool.from_tensor(layout, engine_kv) to cache in the engine's own KV tensor

prompt = list(range(1000))  # one request's token ids, the same on every rank
for turn in range(2):
    lease, hit = cache.lock(prompt)  # match + pin the cached prefix: hit.device_pages, hit.host_pages
    loaded = cache.load(lease)  # host hits back to device; loaded.wait_layer(i) before layer i
    fresh = cache.alloc(lease, hit.num_pages - len(loaded.device_pages))  # pages for the uncached rest
    # ... the forward pass writes the new tokens' KV into `fresh` (cache.device_pool.layer_kv(i)) ...
    cache.insert(lease, prompt, loaded.device_pages + fresh)
    cache.release(lease)  # waits for copies into its pages before freeing them
    cache.step()  # the round: exactly one all-reduce, on the main thread, once per scheduler step
    print(f"rank {dist.get_rank()} turn {turn}: {hit.device_pages + hit.host_pages} of {hit.num_pages} pages hit")
cache.close()
dist.destroy_process_group()
