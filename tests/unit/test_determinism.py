"""The same operation stream gives the same state in separate processes, whatever their hash seed:
nothing that decides cache state may depend on ``hash()``, set order or object ids."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, random
from tpcache.core import CacheConfig, CacheCore, check
from tpcache.replay import drain
from tpcache.testing.ops import apply, random_op

out = []
for policy, evict in (("write_through", "lru"), ("write_back", "lfu"), ("write_through_selective", "fifo")):
    config = CacheConfig(page_size=4, device_pages=24, host_pages=12, write_policy=policy, eviction_policy=evict,
                         storage=True, retention_cap_tokens=32)
    core, rng, leases = CacheCore(config), random.Random(11), []
    for i in range(1500):
        apply(core, random_op(rng, 4, alphabet=5), leases)
        if i % 7 == 0:
            drain(core)
    check(core)
    out.append([core.state_digest(), core.clock, core.device.used, core.host.used, len(core.tree.nodes)])
print(json.dumps(out))
"""


def _run(hash_seed: str) -> list:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_two_processes_with_different_hash_seeds_reach_the_same_state():
    a, b = _run("1"), _run("4242")
    assert a == b
    assert len({tuple(x) for x in a}) == 3  # the three configurations really differ
