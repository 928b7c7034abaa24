"""Cache keys of SGLang requests that carry an ``extra_key`` (LoRA) or a ``cache_salt`` (pure: no
SGLang import).

SGLang keeps such requests in a namespace of their own: they match only pages cached under the same
``(extra_key, cache_salt)``. tpcache's tree keys a page by its int32 token ids, and a real token id is
never negative, so a namespaced key is the request's tokens with the first ``digits`` of them
rewritten to negative ids that carry both the token and one base-``base`` digit of the namespace's
64-bit xxh3 digest: ``-(1 + token * base + digit)``. The rewrite is one-to-one, so a namespaced key
never equals a plain key (its first token is negative) nor a key of another namespace (its first page
spells out the digest), and the first page carries the whole digest, so no page of one namespace
matches under another. The ``base`` is the most that fits int32 for the model's vocabulary; a page too
short to hold the digest leaves namespaced requests uncached (``Namespaces.usable`` is False).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence

import xxhash

_INT32_MAX = 2**31 - 1
_SEED = 0x7470636163686532  # "tpcache2": digests of SGLang namespaces


def namespace_digest(extra_key: str | None, cache_salt: str | None) -> int:
    """The 64-bit digest of one namespace (xxh3 of its JSON form: the same on every rank and run)."""
    return xxhash.xxh3_64_intdigest(json.dumps([extra_key, cache_salt]).encode("utf-8"), seed=_SEED)


class Namespaces:
    def __init__(self, page_size: int, vocab_size: int) -> None:
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.base = _INT32_MAX // max(vocab_size, 1)
        digits, room = 0, 1
        while room < 2**64 and self.base >= 2:
            room *= self.base
            digits += 1
        self.digits = digits
        self.usable = self.base >= 2 and digits <= page_size

    def key(self, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None) -> bytes | None:
        """The key bytes of ``tokens`` (whole pages) in the namespace; None: the request goes uncached
        (the page cannot hold the digest, or a token is outside the vocabulary)."""
        if not self.usable or len(tokens) < self.page_size:
            return None
        digest = namespace_digest(extra_key, cache_salt)
        out = array("i", tokens)
        base, vocab = self.base, self.vocab_size
        for i in range(self.digits):
            token = out[i]
            if not 0 <= token < vocab:
                return None
            digest, digit = divmod(digest, base)
            out[i] = -(1 + token * base + digit)
        return out.tobytes()
