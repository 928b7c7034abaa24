"""Mooncake-format traces: one JSON object per line with ``input_length`` and ``hash_ids``.

Each hash id names a 512-token block and covers every block before it, so equal ids at one
position mean an equal prefix. Token ids are derived from the ids so that equal ids give equal
tokens; a request's last block is partial unless ``input_length`` is a multiple of 512.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
_TOKEN_SPACE = 1 << 30


@dataclass(frozen=True)
class Request:
    input_length: int
    hash_ids: tuple[int, ...]
    output_length: int = 0
    timestamp: int = 0


class TraceError(ValueError):
    pass


def load_trace(path: str | Path, limit: int | None = None) -> Iterator[Request]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and lineno > limit:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = Request(
                    input_length=int(obj["input_length"]),
                    hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                    output_length=int(obj.get("output_length", 0)),
                    timestamp=int(obj.get("timestamp", 0)),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            needed = -(-req.input_length // TRACE_BLOCK_TOKENS)
            if req.input_length < 0 or len(req.hash_ids) < needed:
                raise TraceError(
                    f"{path}:{lineno}: input_length {req.input_length} needs {needed} hash ids, got {len(req.hash_ids)}"
                )
            yield req


_TEMPLATE = array("i", range(TRACE_BLOCK_TOKENS))
_STAMP_EVERY = 32  # the id is stamped into every 32 tokens, so pages as small as 32 differ too


def block_tokens(hash_id: int, n: int = TRACE_BLOCK_TOKENS) -> array:
    """The tokens of one block: a fixed template with the block's id stamped in, so equal ids
    give equal tokens and different ids give different tokens at every 32-token boundary."""
    if hash_id < 0:
        raise TraceError(f"hash ids must be non-negative, got {hash_id}")
    blk = array("i", _TEMPLATE)
    lo, hi = hash_id % _TOKEN_SPACE, hash_id // _TOKEN_SPACE % _TOKEN_SPACE
    for k in range(0, TRACE_BLOCK_TOKENS, _STAMP_EVERY):
        blk[k] = lo
        blk[k + 1] = hi
    return blk[:n] if n < TRACE_BLOCK_TOKENS else blk


def request_tokens(req: Request) -> array:
    """Token ids for a request: block b's tokens are a function of ``hash_ids[b]`` alone."""
    out = array("i")
    remaining = req.input_length
    for h in req.hash_ids:
        if remaining <= 0:
            break
        n = min(TRACE_BLOCK_TOKENS, remaining)
        out.extend(block_tokens(h, n))
        remaining -= n
    return out
