"""A plain lookup (``core.lookup``, in C where built) against ``CacheCore.match``, which it stands in
for on a service's lookups: the same device hit, host hit and device pages after every op of random
schedules, with copies in flight (pages loading, slots being written), a host tier, buffer mode
(host slots never hit), a closed cache and hybrid components (which ``lookup`` leaves to ``match``)."""

from __future__ import annotations

import random

import pytest

import tpcache.core.treecore.lookup as lookup_module
from tpcache.core import CacheConfig, CacheCore
from tpcache.core.treecore.lookup import lookup as lookup_of
from tpcache.core.treecore.tree import NATIVE_NODES
from tpcache.replay import drain
from tpcache.testing.ops import apply, random_op, tokens_for

PAGE = 4
CONFIGS = {
    "device": {"device_pages": 24},
    "host": {"device_pages": 16, "host_pages": 24, "write_policy": "write_through"},
    "buffer": {
        "device_pages": 16,
        "host_pages": 24,
        "write_policy": "write_through",
        "host_mode": "buffer",
        "storage": True,
    },
    "swa": {
        "device_pages": 24,
        "host_pages": 24,
        "write_policy": "write_through",
        "swa_window": 8,
        "swa_device_pages": 16,
    },
}


def expected(core: CacheCore, tokens: list[int]) -> tuple[int, int, list[int]]:
    m = core.match(tokens)
    return m.device_pages, m.host_pages, m.device_page_ids


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_a_lookup_finds_what_match_finds(config, seed):
    _schedule(config, seed, PAGE, alphabet=4)


@pytest.mark.parametrize(("page_size", "alphabet"), [(1, 4), (16, 4), (4, 40)])
def test_a_lookup_finds_what_match_finds_at_other_pages_and_fan_outs(page_size, alphabet):
    """Pages of 1 and 16 tokens, and nodes with more children than the kernel scans (a dict lookup)."""
    _schedule("host", page_size + alphabet, page_size, alphabet)


def test_without_the_kernel_a_lookup_is_match_s(monkeypatch):
    monkeypatch.setattr(lookup_module, "_native_lookup", None)
    _schedule("host", 7, PAGE, alphabet=4)


@pytest.mark.parametrize("tokens", [[1, 2**31], [1.5], "abcd", b"abc", None, [[1]]])
def test_a_lookup_refuses_what_match_refuses(tokens):
    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=8))
    with pytest.raises(Exception) as refused:
        core.match(tokens)
    with pytest.raises(type(refused.value)):
        lookup_of(core, tokens)


def _schedule(config: str, seed: int, page: int, alphabet: int) -> None:
    core = CacheCore(CacheConfig(page_size=page, **CONFIGS[config]))
    rng = random.Random(seed)
    leases: list = []
    seen: list[list[int]] = []
    native = host_hits = host_only = 0
    for step in range(300):
        op = random_op(rng, page, alphabet=alphabet, requests=0.4, appends=0.1)
        apply(core, op, leases)
        if op[0] in ("lock", "request"):
            seen.append(tokens_for(op[1], page, op[2]))
        if rng.random() < 0.3:
            drain(core)  # otherwise copies stay in flight: loading pages, slots being written
        for tokens in seen[-12:] + [t[: rng.randrange(len(t) + 1)] for t in seen[-4:]]:
            dev, host, pages = lookup_of(core, tokens)
            assert (dev, host, pages.tolist()) == expected(core, tokens), f"step {step}: {op}"
            assert pages.typecode == "i"
            native += dev + host > 0
            host_hits += host > 0
        host_only += any(n.host_state == 2 and n.device_state == 0 for n in core.tree.nodes.values())
    assert native > 100
    if config == "host":
        assert host_hits > 10  # host hits were looked up, not only device ones
    if config == "buffer":
        assert host_hits == 0 and host_only > 10  # host-only pages, which buffer mode never counts
    core.close("the test closes it")
    assert all(lookup_of(core, t) == (0, 0, lookup_of(core, [])[2]) for t in seen)


@pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")
def test_the_kernel_refuses_what_it_cannot_read():
    from tpcache.core.treecore import _node

    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=8))
    with pytest.raises(ValueError, match="token bytes"):
        _node.lookup(core.tree.root, [1, 2, 3, 4], PAGE * 4, True)
    with pytest.raises(ValueError):
        _node.lookup(core.tree.root, b"", 0, True)
    assert _node.lookup(object(), b"", PAGE * 4, True) is None
