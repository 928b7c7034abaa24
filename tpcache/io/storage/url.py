"""Storage URLs: which backend the storage tier uses, and its settings, in one string.

    file:///PATH[?fsync=batch&capacity=1GiB]
    mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata[&protocol=tcp&device=...]
    redis://[[user]:password@]HOST:PORT/DB[?timeout=2&prefix=tpcache/]   (also rediss://, valkey://)

Both remote stores take ``deadline`` (seconds, default 2; 0: none): every call answers within it
or is abandoned, and calls fail fast for ``retry_s`` (default 1) after (see ``remote``).

``parse_storage_url`` checks a URL without importing any store client (config validation runs it
on every rank before anything starts); ``open_storage`` builds the backend for one TP shard.
Sizes take a binary suffix (``64MiB``, ``1GiB``) or plain bytes. Unknown settings are errors, so a
misspelt one never silently falls back to a default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from tpcache.comm.parallel import Shard
from tpcache.io.storage.base import StorageBackend

_SIZE = re.compile(r"([0-9]+)\s*(|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)", re.IGNORECASE)
_SCALE = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}

# setting -> kind, per scheme
_COMMON = {"prefix": "str", "retry_s": "float", "deadline": "float"}
_SETTINGS: dict[str, dict[str, str]] = {
    "file": {"fsync": "str", "capacity": "size", "segment": "size"},
    "mooncake": {
        "metadata": "str",
        "protocol": "str",
        "device": "str",
        "local_hostname": "str",
        "segment": "size",
        "local_buffer": "size",
        "staging": "size",
        "direct_put": "size",
        "direct_get": "size",
        **_COMMON,
    },
    "redis": {"timeout": "float", "batch": "size", **_COMMON},
}
_REDIS_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


class StorageURLError(ValueError):
    """A storage URL that names no backend, or a setting that backend does not have."""


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise StorageURLError(f"{text!r} is not a size (bytes, or e.g. 64MiB, 1GiB)")
    return int(m[1]) << _SCALE[m[2][:1].lower()]


@dataclass(frozen=True)
class StorageURL:
    """A parsed storage URL: ``backend`` is file, mooncake or redis; ``settings`` are typed."""

    backend: str
    location: str  # file: the directory; mooncake: master host:port; redis: the client URL
    settings: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    def describe(self) -> str:
        """For logs: the backend and where it is, with any password masked."""
        if self.backend == "file":
            return f"file storage in {self.location}"
        if self.backend == "mooncake":
            return f"Mooncake Store, master {self.location}, metadata {self.settings['metadata']}"
        parts = urlsplit(self.location)
        host = f"{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"
        return f"Redis-protocol store at {parts.scheme}://{host}"


def _typed(backend: str, query: str) -> dict[str, Any]:
    allowed = _SETTINGS[backend]
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        kind = allowed.get(name)
        if kind is None:
            raise StorageURLError(
                f"the {backend} storage URL has no setting {name!r}; known: {', '.join(sorted(allowed))}"
            )
        if name in out:
            raise StorageURLError(f"storage URL setting {name!r} is given twice")
        try:
            out[name] = parse_size(value) if kind == "size" else float(value) if kind == "float" else value
        except ValueError:
            raise StorageURLError(f"storage URL setting {name}={value!r} is not a {kind}") from None
        if name in ("deadline", "retry_s") and not out[name] >= 0:
            raise StorageURLError(f"storage URL setting {name}={value!r}: must be >= 0 seconds (deadline 0: none)")
    return out


def parse_storage_url(text: str) -> StorageURL:
    """Check ``text`` and split it into backend, location and settings (imports no client)."""
    if not isinstance(text, str) or "://" not in text:
        raise StorageURLError(
            f"storage URL must look like file:///PATH, mooncake://HOST:PORT?metadata=URL or redis://HOST:PORT/DB, "
            f"got {text!r}"
        )
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise StorageURLError(f"a file storage URL needs an absolute path: file:///PATH, got {text!r}")
        settings = _typed("file", parts.query)
        return StorageURL("file", unquote(parts.path), settings, text)
    if scheme == "mooncake":
        if not parts.hostname or parts.port is None or parts.path not in ("", "/"):
            raise StorageURLError(f"a Mooncake storage URL needs the master as mooncake://HOST:PORT, got {text!r}")
        settings = _typed("mooncake", parts.query)
        if not settings.get("metadata"):
            raise StorageURLError(
                "a Mooncake storage URL needs its metadata service: ?metadata=http://HOST:PORT/metadata"
            )
        return StorageURL("mooncake", f"{parts.hostname}:{parts.port}", settings, text)
    if scheme in _REDIS_SCHEMES:
        if not parts.hostname:
            raise StorageURLError(f"a Redis storage URL needs a host: redis://HOST:PORT/DB, got {text!r}")
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise StorageURLError(f"the Redis database in {parts.path!r} must be a number")
        settings = _typed("redis", parts.query)
        client_url = urlunsplit((_REDIS_SCHEMES[scheme], parts.netloc, f"/{db}", "", ""))
        return StorageURL("redis", client_url, settings, text)
    raise StorageURLError(f"unknown storage URL scheme {parts.scheme!r}; use file, mooncake or redis")


def file_url(path: str | Path) -> str:
    """The ``file://`` URL of a directory (what ``--storage-dir`` means)."""
    return "file://" + quote(str(Path(path).resolve()))


def open_storage(
    url: str | StorageURL,
    *,
    shard: tuple[int, ...],
    capacity_bytes: int = 1 << 30,
    storage_key: bytes | None = None,
) -> StorageBackend:
    """The backend ``url`` names, serving TP shard ``(rank, size)`` or a ``Shard`` of a PP x TP group.

    ``capacity_bytes`` bounds a file backend (``?capacity=`` overrides it); shared stores size
    themselves. A file URL keeps each rank in ``PATH/rank<r>`` (r the global rank), as
    ``--storage-dir`` always has. ``storage_key``: the deployment's secret (every instance sharing
    the store holds the same): records are signed and served only when their MAC verifies.
    """
    backend = _open(url, shard, capacity_bytes)
    if storage_key:
        from tpcache.io.storage.record import RecordMac

        backend.authenticate(RecordMac(storage_key))
    return backend


def _open(url: str | StorageURL, shard: tuple[int, ...], capacity_bytes: int) -> StorageBackend:
    spec = url if isinstance(url, StorageURL) else parse_storage_url(url)
    s = dict(spec.settings)
    if spec.backend == "file":
        from tpcache.io.storage.file import DEFAULT_SEGMENT_BYTES, FileBackend

        return FileBackend(
            Path(spec.location) / f"rank{Shard(*shard).rank}",
            capacity_bytes=s.get("capacity", capacity_bytes),
            fsync=s.get("fsync", "batch"),
            shard=shard,
            segment_bytes=s.get("segment", DEFAULT_SEGMENT_BYTES),
        )
    common = {k: s.pop(k) for k in ("prefix", "retry_s") if k in s}
    if "deadline" in s:
        common["deadline_s"] = s.pop("deadline")
    if spec.backend == "mooncake":
        from tpcache.io.storage.mooncake_store import MooncakeBackend

        renames = {
            "segment": "segment_bytes",
            "local_buffer": "local_buffer_bytes",
            "staging": "staging_bytes",
            "direct_put": "direct_put_bytes",
            "direct_get": "direct_get_bytes",
        }
        kwargs = {renames.get(k, k): v for k, v in s.items() if k != "metadata"}
        return MooncakeBackend(spec.location, s["metadata"], shard=shard, **kwargs, **common)
    from tpcache.io.storage.redis_store import RedisBackend

    renames = {"timeout": "timeout_s", "batch": "batch_bytes"}
    return RedisBackend(spec.location, shard=shard, **{renames[k]: v for k, v in s.items()}, **common)
