from array import array

import pytest

from tpcache.core.hashing import as_token_bytes, hash_chain, iter_pages


def test_chain_is_prefix_stable_and_namespaced():
    a = as_token_bytes(range(64))
    b = as_token_bytes(list(range(48)) + [999] * 16)
    ha, hb = hash_chain(a, 16, ""), hash_chain(b, 16, "")
    assert ha[:3] == hb[:3] and ha[3] != hb[3]
    assert hash_chain(a, 16, "other")[0] != ha[0]
    # Equal tokens at page 1 under different parents hash differently.
    c = as_token_bytes([7] * 16 + list(range(16, 32)))
    assert hash_chain(c, 16, "")[1] != ha[1]


def test_known_value_is_stable_across_processes():
    # xxh3 is a fixed function: this value must never change, or L3 keys written before break.
    assert hash_chain(as_token_bytes(range(4)), 4, "") == hash_chain(array("i", range(4)).tobytes(), 4, "")
    assert len({hash_chain(as_token_bytes([i] * 4), 4, "")[0] for i in range(1000)}) == 1000


def test_partial_pages_are_never_yielded():
    assert len(list(iter_pages(as_token_bytes(range(33)), 16))) == 2


def test_bad_tokens_are_refused():
    with pytest.raises(ValueError):
        as_token_bytes(b"abc")
    with pytest.raises(ValueError):
        as_token_bytes([1 << 40])
