"""Keys of SGLang requests with an ``extra_key`` or ``cache_salt`` (``tpcache.integrations.sglang.keys``):
a namespaced key matches only keys of the same namespace, page for page."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from pathlib import Path

from tpcache.integrations.sglang.keys import Namespaces, namespace_digest

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16


def _first_page(key: bytes) -> bytes:
    return key[: 4 * PAGE]


def test_namespaced_keys_equal_only_in_the_same_namespace() -> None:
    spaces = Namespaces(PAGE, vocab_size=32000)
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(3 * PAGE)]
    plain = array("i", tokens).tobytes()
    names = [(None, "a"), (None, "b"), ("a", None), ("a", "a"), ("lora-1", None), ("", None)]
    keys = {name: spaces.key(tokens, *name) for name in names}
    assert all(key is not None and len(key) == len(plain) for key in keys.values())
    firsts = [_first_page(key) for key in keys.values()] + [_first_page(plain)]
    # No two namespaces (nor the plain key) share even their first page, so no page matches across.
    assert len(set(firsts)) == len(firsts)
    # The same namespace gives the same key, and pages past the first are the plain tokens.
    assert spaces.key(tokens, None, "a") == keys[(None, "a")]
    assert all(key[4 * PAGE :] == plain[4 * PAGE :] for key in keys.values())
    # Prefixes stay prefixes: a shorter request's key is the start of a longer one's.
    assert spaces.key(tokens[: 2 * PAGE], None, "a") == keys[(None, "a")][: 8 * PAGE]


def test_different_tokens_in_one_namespace_never_collide() -> None:
    spaces = Namespaces(PAGE, vocab_size=100)
    rng = random.Random(7)
    seen: dict[bytes, tuple] = {}
    for _ in range(2000):
        page = tuple(rng.randrange(100) for _ in range(PAGE))
        salt = rng.choice(["x", "y", None])
        key = spaces.key(page, "k" if salt is None else None, salt)
        assert seen.setdefault(key, (page, salt)) == (page, salt)
        assert all(t < 0 for t in array("i", key)[: spaces.digits])


def test_a_page_too_short_for_the_digest_or_a_token_outside_the_vocabulary_goes_uncached() -> None:
    big_vocab = Namespaces(2, vocab_size=262144)  # 8191 values a token: 5 tokens for 64 bits
    assert not big_vocab.usable and big_vocab.key([1, 2, 3, 4], None, "a") is None
    spaces = Namespaces(PAGE, vocab_size=1000)
    assert spaces.usable and spaces.key([5] * PAGE, None, "a") is not None
    assert spaces.key([1000] + [5] * (PAGE - 1), None, "a") is None
    assert spaces.key([5] * (PAGE - 1), None, "a") is None


def test_the_digest_is_the_same_in_every_process() -> None:
    code = "from tpcache.integrations.sglang.keys import namespace_digest as d; print(d('lora', 'salt'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(namespace_digest("lora", "salt"))}
    assert namespace_digest("lora", None) != namespace_digest(None, "lora")
