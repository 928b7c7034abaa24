"""Page hashes and digests are stored values: a cache's pages in storage, the state digests the
ranks agree on and the event stream's digests are compared across processes, versions and hosts.
Both tree cores must compute these, written down once, for every length branch of XXH3 (inputs of
12 to 4,128 bytes, with and without a namespace seed), the digest mixes and whole schedules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tpcache.core import CacheConfig, CacheCore, backend
from tpcache.core.digest import mix, mix_ids
from tpcache.testing import sim

# The last page hash of a three-page chain, by page size (tokens) and namespace.
PAGES = {
    "1/": 8965487479243116208,
    "1/model-a": 7392368295842001205,
    "4/": 1432418594072520454,
    "4/model-a": 4724701414472476090,
    "16/": 7872107931821110988,
    "16/model-a": 9381925274487652675,
    "30/": 6000772959761893706,
    "30/model-a": 17464693193723039500,
    "31/": 9522240047922283206,
    "31/model-a": 298896611457472224,
    "58/": 9528472225164357515,
    "58/model-a": 1876776255349341690,
    "59/": 15041349724006160117,
    "59/model-a": 10583696623939667719,
    "512/": 2767169727685119571,
    "512/model-a": 13508556789951848765,
    "1030/": 13659316674917015042,
    "1030/model-a": 8802067332134207230,
}
# mix_ids of n ids (8n bytes).
IDS = {
    "0": 3244421341483603138,
    "1": 2990684495068481313,
    "2": 3882506972659536339,
    "3": 3431056729402572963,
    "16": 1804577237944525537,
    "17": 814498060253384819,
    "30": 2480916437957191543,
    "31": 3096972598353179033,
    "40": 631251883033712597,
}
MIXES = [2772291371507553031, 3457472693978015086, 3847216004804875278]
SCHEDULES = [3858189523258717728, 402178016493076406]  # rank 0's state digest after seeds 3 and 5 ("both")
STORED = {"pages": PAGES, "ids": IDS, "mix": MIXES, "schedules": SCHEDULES}


def fingerprint() -> dict:
    pages = {}
    for page_size in (1, 4, 16, 30, 31, 58, 59, 512, 1030):
        for namespace in ("", "model-a"):
            core = CacheCore(CacheConfig(page_size=page_size, device_pages=8, namespace=namespace))
            tokens = [(i * 7919 + page_size) % 50000 for i in range(page_size * 3)]
            lease, _ = core.lock(tokens)
            core.insert(lease, tokens, core.alloc(lease, 3))
            pages[f"{page_size}/{namespace}"] = max(core.tree.nodes.items())[1].hash
    ids = {str(n): mix_ids([i * 0x9E3779B1 - 5 for i in range(n)]) for n in (0, 1, 2, 3, 16, 17, 30, 31, 40)}
    mixes = [mix(1, -2, 3), mix(0), mix(2**64 - 1, -(2**63), 2**63 - 1, 4, 5, 6, 7, 8)]
    runs = ((3, None), (5, "both"))
    schedules = [sim.run_schedule(seed, 2, hybrid=hybrid).ranks[0].core.digest.value for seed, hybrid in runs]
    return {"pages": pages, "ids": ids, "mix": mixes, "schedules": schedules}


def test_this_processs_tree_core_computes_the_stored_values():
    assert fingerprint() == STORED


@pytest.mark.skipif(not backend.BUILT, reason="the native extension was not built (no C compiler)")
def test_the_other_tree_core_computes_the_stored_values():
    other = "reference" if backend.NAME == "native" else "native"
    code = "import json\nfrom tests.treecore.test_stored_hashes import fingerprint\nprint(json.dumps(fingerprint()))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, backend.ENV: other},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(done.stdout.splitlines()[-1]) == STORED
