"""Deterministic page hash chain.

A page's hash covers its parent's hash, its tokens and a namespace salt, so equal hashes mean equal
prefixes (up to a 64-bit collision, which the tree guards against by also comparing tokens).
xxh3_64 is stable across processes, platforms and Python versions, unlike ``hash()``.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence

import xxhash

from tpcache.core.backend import NATIVE

HASH_MASK = (1 << 64) - 1
_U64 = struct.Struct("<Q")

TokenIds = Sequence[int] | array | bytes | memoryview

_token_bytes = NATIVE.token_bytes if NATIVE is not None else None


def namespace_seed(namespace: str) -> int:
    """The salt for one namespace: caches with different namespaces never share pages."""
    return xxhash.xxh3_64_intdigest(namespace.encode("utf-8"), seed=0x7470636163686531)


def root_hash(namespace: str) -> int:
    """The hash chain's starting value (the root's hash) for a namespace."""
    return xxhash.xxh3_64_intdigest(b"tpcache-root", seed=namespace_seed(namespace))


def page_hash(parent_hash: int, page_tokens: bytes, seed: int) -> int:
    """hash(parent page hash, page tokens, namespace salt) as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(_U64.pack(parent_hash) + page_tokens, seed=seed)


def as_token_bytes(tokens: TokenIds) -> bytes:
    """Token ids as little-endian int32 bytes, the form pages are keyed and hashed by."""
    if type(tokens) is bytes and not len(tokens) % 4:
        return tokens  # already converted (lock, match and insert each take the caller's bytes)
    if _token_bytes is not None and (data := _token_bytes(tokens)) is not None:
        return data  # a list or tuple of ints, converted in C (_chain.c) as below (None for anything else)
    if isinstance(tokens, bytes | bytearray | memoryview):
        data = bytes(tokens)
        if len(data) % 4:
            raise ValueError(f"token bytes must be a multiple of 4 long (int32), got {len(data)} bytes")
        return data
    if isinstance(tokens, array) and tokens.typecode == "i" and tokens.itemsize == 4:
        arr = tokens
    else:
        try:
            arr = array("i", tokens)
        except OverflowError as exc:
            raise ValueError("token ids must fit in int32") from exc
    if arr.itemsize != 4:
        raise ValueError("this platform's C int is not 32 bits")
    return arr.tobytes()


def iter_pages(token_bytes: bytes, page_size: int) -> Iterator[bytes]:
    """The full pages of a token sequence; a partial last page is never yielded."""
    step = page_size * 4
    for start in range(0, len(token_bytes) - step + 1, step):
        yield token_bytes[start : start + step]


def hash_chain(token_bytes: bytes, page_size: int, namespace: str) -> list[int]:
    """The hash of every full page, each covering all pages before it."""
    return extend_chain(root_hash(namespace), token_bytes, page_size, namespace_seed(namespace))


def extend_chain(parent_hash: int, token_bytes: bytes, page_size: int, seed: int) -> list[int]:
    """``hash_chain`` of the full pages that follow the page hashed ``parent_hash`` (the root's
    hash for the first page): the hash of each, in order."""
    h = parent_hash
    out = []
    for page in iter_pages(token_bytes, page_size):
        h = page_hash(h, page, seed)
        out.append(h)
    return out
