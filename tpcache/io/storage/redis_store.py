"""Redis protocol backend (Redis, Valkey, and anything speaking RESP): one string value per page.

A call is pipelined (``SET``/``EXISTS``/``DEL``, no transaction; reads as one ``MGET``) in rounds
of at most ``batch_bytes``, one round trip each. A ``SET`` sends the record as one value, so a
reader sees the old value or the new one, never a mix; a key that holds another type than a string
reads as missing. The server's own eviction (``maxmemory-policy``)
drops keys one by one, so one rank's shard of a page can vanish while another's stays: a miss;
a server at ``maxmemory`` with ``noeviction`` refuses writes: ``no_space``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from tpcache.io.storage.base import (
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_MISSING,
    PUT_IO_ERROR,
    PUT_NO_SPACE,
    StorageError,
)
from tpcache.io.storage.remote import (
    DEFAULT_DEADLINE_S,
    DEFAULT_PREFIX,
    DEFAULT_RETRY_S,
    RemoteBackend,
    Sink,
    StoreUnavailable,
)

DEFAULT_TIMEOUT_S = DEFAULT_DEADLINE_S
DEFAULT_BATCH_BYTES = 64 << 20


def _redis() -> Any:
    try:
        import redis
    except ModuleNotFoundError:
        raise StorageError("the Redis backend needs the redis client: pip install 'tpcache[redis]'") from None
    return redis


class RedisBackend(RemoteBackend):
    """Pages in a Redis-protocol server; see the module docstring.

    Args:
        url: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS), as redis-py
            reads it.
        shard: ``(tp_rank, tp_size)`` this instance serves; keys of other shards are rejected.
        timeout_s: socket connect and read timeout; a server that does not answer within it
            makes the call fail (and the next ``retry_s`` of calls fail at once).
        deadline_s: a whole call (all its round trips) answers within this or is abandoned
            (``remote``); 0: none.
        batch_bytes: most value bytes in one pipelined round trip.
    """

    scheme = "redis"
    _stable_values = True  # MGET's values are bytes objects of this process

    def __init__(
        self,
        url: str,
        *,
        shard: tuple[int, int] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        prefix: str = DEFAULT_PREFIX,
        retry_s: float = DEFAULT_RETRY_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        parts = urlsplit(url)
        where = f"{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"
        super().__init__(shard=shard, prefix=prefix, retry_s=retry_s, where=where, deadline_s=deadline_s)
        if timeout_s <= 0 or batch_bytes <= 0:
            raise ValueError("timeout_s and batch_bytes must be positive")
        redis = _redis()
        from redis.backoff import ExponentialWithJitterBackoff
        from redis.retry import Retry

        self._errors = redis.exceptions
        self._batch_bytes = batch_bytes
        # One quick retry: a pooled connection the server dropped (restart) fails once, then works.
        # Never after a timeout: a stalled server would cost the timeout twice. With a deadline, the
        # socket times out at twice it: the deadline, not a socket timeout racing it, abandons a
        # stalled call (counted deadline_exceeded), and the abandoned call still returns soon after.
        if deadline_s:
            timeout_s = min(timeout_s, 2 * deadline_s)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(
                ExponentialWithJitterBackoff(base=0.008, cap=0.128), 1, supported_errors=(redis.ConnectionError,)
            ),
        )
        try:
            self._client.ping()
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            self._client.close()
            raise StorageError(f"cannot reach the Redis server at {where}: {exc}") from None
        except self._errors.ResponseError as exc:
            self._client.close()
            raise StorageError(f"the Redis server at {where} refused us: {exc}") from None

    def _shard_names(self, echoes: list[bytes]) -> list[Any]:
        prefix = self._prefix.encode("utf-8")  # the bytes the client sends for the str name
        return [prefix + e for e in echoes]

    def _rounds(self, sizes: list[int]) -> list[range]:
        out: list[range] = []
        start = total = 0
        for i, size in enumerate(sizes):
            if i > start and total + size > self._batch_bytes:
                out.append(range(start, i))
                start, total = i, 0
            total += size
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out

    def _run(self, fill: Any) -> list[Any]:
        """One pipelined round trip; per-command errors come back as exception objects."""
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        try:
            return list(pipe.execute(raise_on_error=False))
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            raise StoreUnavailable(str(exc)) from None
        finally:
            pipe.reset()

    def _exists(self, names: list[str]) -> list[bool]:
        replies = self._run(lambda p: [p.exists(n) for n in names])
        return [r == 1 for r in replies]

    def _put(self, names: list[str], heads: list[bytes], payloads: list[memoryview]) -> list[str | None]:
        sizes = [len(h) + len(p) for h, p in zip(heads, payloads, strict=True)]
        return self._set(names, sizes, lambda idx: [b"".join((heads[i], payloads[i])) for i in idx])

    def _put_records(self, names: list[str], records: list[bytes]) -> list[str | None]:
        return self._set(names, [len(r) for r in records], lambda idx: records[idx.start : idx.stop])

    def _set(self, names: list[str], sizes: list[int], values: Any) -> list[str | None]:
        """``SET`` of each key's record (``values(idx)``: the records of a round's keys)."""
        reasons: list[str | None] = [PUT_IO_ERROR] * len(names)
        for idx in self._rounds(sizes):

            def fill(pipe: Any, idx: range = idx) -> None:
                for name, value in zip(names[idx.start : idx.stop], values(idx), strict=True):
                    pipe.set(name, value)

            for i, reply in zip(idx, self._run(fill), strict=True):
                if reply is True:
                    reasons[i] = None
                elif isinstance(reply, self._errors.OutOfMemoryError):
                    reasons[i] = PUT_NO_SPACE
        return reasons

    def _get(self, names: list[str], sizes: list[int], sink: Sink, out: list[memoryview]) -> None:
        for idx in self._rounds(sizes):
            (replies,) = self._run(lambda p, idx=idx: p.mget(names[idx.start : idx.stop]))
            if not isinstance(replies, list) or len(replies) != len(idx):  # an error reply for the command
                for i in idx:
                    sink(i, None, MISS_IO_ERROR)
                continue
            for i, reply in zip(idx, replies, strict=True):
                if reply is None:
                    sink(i, None, MISS_MISSING)
                elif isinstance(reply, bytes):
                    sink(i, reply, None)
                else:
                    sink(i, None, MISS_FOREIGN)

    def _get_records(self, names: list[str], sizes: list[int], take: Any) -> None:
        for idx in self._rounds(sizes):
            (replies,) = self._run(lambda p, idx=idx: p.mget(names[idx.start : idx.stop]))
            if not isinstance(replies, list) or len(replies) != len(idx):  # an error reply for the command
                take(idx.start, [None] * len(idx), [MISS_IO_ERROR] * len(idx))
            else:  # a reply that is not a bytes value (None: no such key) takes the caller's Python check
                take(idx.start, replies, None)

    def _delete(self, names: list[str]) -> list[bool]:
        replies = self._run(lambda p: [p.delete(n) for n in names])
        return [r == 1 for r in replies]

    def _close(self) -> None:
        self._client.close()
