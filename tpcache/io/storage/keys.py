"""Storage keys: which rank's shard of which page, under which namespace and KV layout.

Invariants:
- ``encode()`` is a pure function of the fields, versioned (``v1/...``), and made only of
  ``[A-Za-z0-9._-]`` components joined by ``/``; no component is empty, ``.`` or ``..``, so an
  encoded key used as a relative path can never leave its directory.
- ``decode(encode(k)) == k`` and ``decode`` rejects every string ``encode`` cannot produce.
- Two keys that differ in any field (namespace, layout version, TP rank or size, pipeline
  stage or stage count, context rank or count, page hash) encode differently, so ranks never read
  each other's shards and a layout change never reads old bytes as new ones. A plain TP key
  (one stage, one context rank) has no stage or context component: ``v1/n_llama/3/0of4/00ab...``;
  with stages, ``v1/n_llama/3/p1of2/0of2/00ab...`` (and ``c0of2`` after the stage with context ranks).
- A model shard key (``layers`` and ``heads`` set) names a range of the model's global layers and KV
  heads instead of a writer's place, under format ``v2``: ``v2/n_llama/77/l0-7.h2-2/00ab...`` (layers
  0-7, KV head 2; ``layout_version`` is then the model's layout id, see ``sharded.ModelShape``). It
  is the same for every group shape that stores or reads that range, and it never equals a ``v1`` key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tpcache.comm.parallel import Shard

KEY_FORMAT = "v1"
SHARD_KEY_FORMAT = "v2"
MAX_LAYERS = 1 << 20
MAX_HEADS = 1 << 20
MAX_NAMESPACE_BYTES = 100  # hex-encoded that is 202 chars, still under NAME_MAX (255)
MAX_LAYOUT_VERSION = (1 << 31) - 1
MAX_TP_SIZE = 1 << 16
MAX_PAGE_HASH = (1 << 64) - 1

# A namespace is kept readable when it is plainly safe; anything else is hex-encoded.
_SAFE_NAMESPACE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_ENCODED = re.compile(
    r"v1/(?:n_(?P<plain>[A-Za-z0-9_-][A-Za-z0-9._-]*)|x_(?P<hex>(?:[0-9a-f]{2})*))"
    r"/(?P<layout>0|[1-9][0-9]*)"
    r"(?:/p(?P<stage>0|[1-9][0-9]*)of(?P<stages>[1-9][0-9]*))?"
    r"(?:/c(?P<cp>0|[1-9][0-9]*)of(?P<cps>[1-9][0-9]*))?"
    r"/(?P<rank>0|[1-9][0-9]*)of(?P<size>[1-9][0-9]*)/(?P<hash>[0-9a-f]{16})"
)
_NUM = r"(?:0|[1-9][0-9]*)"
_ENCODED_SHARD = re.compile(
    r"v2/(?:n_(?P<plain>[A-Za-z0-9_-][A-Za-z0-9._-]*)|x_(?P<hex>(?:[0-9a-f]{2})*))"
    rf"/(?P<layout>{_NUM})/l(?P<l0>{_NUM})-(?P<l1>{_NUM})\.h(?P<h0>{_NUM})-(?P<h1>{_NUM})/(?P<hash>[0-9a-f]{{16}})"
)


class StorageKeyError(ValueError):
    """A storage key field or encoded key is invalid (wrong type, out of range, unsafe)."""


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    # bool is an int subclass; a True rank is a caller bug, not rank 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise StorageKeyError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise StorageKeyError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def _encode_namespace(namespace: str) -> str:
    raw = namespace.encode("utf-8")
    if _SAFE_NAMESPACE.fullmatch(namespace) and ".." not in namespace:
        return "n_" + namespace
    return "x_" + raw.hex()


@dataclass(frozen=True)
class StorageKey:
    """One rank's shard of one page: the unit every storage backend stores and looks up."""

    namespace: str
    layout_version: int
    tp_rank: int
    tp_size: int
    page_hash: int
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    layers: tuple[int, int] | None = None  # a model shard key: first and last global layer it holds
    heads: tuple[int, int] | None = None  # ... and first and last global KV head

    @classmethod
    def of(cls, namespace: str, layout_version: int, shard: Shard, page_hash: int) -> StorageKey:
        """The key of ``shard``'s slice of the page ``page_hash``."""
        s = Shard(*shard)
        stage, context = (s.pp_rank, s.pp_size), (s.cp_rank, s.cp_size)
        return cls(namespace, layout_version, s.tp_rank, s.tp_size, page_hash, *stage, *context)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str):
            raise StorageKeyError(f"namespace must be a str, got {type(self.namespace).__name__}")
        if "\x00" in self.namespace:
            raise StorageKeyError("namespace must not contain NUL")
        try:
            nbytes = len(self.namespace.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise StorageKeyError(f"namespace is not encodable as UTF-8: {exc}") from None
        if nbytes > MAX_NAMESPACE_BYTES:
            raise StorageKeyError(f"namespace is {nbytes} bytes, the limit is {MAX_NAMESPACE_BYTES}")
        _check_int("layout_version", self.layout_version, 0, MAX_LAYOUT_VERSION)
        _check_int("tp_size", self.tp_size, 1, MAX_TP_SIZE)
        _check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        _check_int("pp_size", self.pp_size, 1, MAX_TP_SIZE)
        _check_int("pp_rank", self.pp_rank, 0, self.pp_size - 1)
        _check_int("cp_size", self.cp_size, 1, MAX_TP_SIZE)
        _check_int("cp_rank", self.cp_rank, 0, self.cp_size - 1)
        _check_int("page_hash", self.page_hash, 0, MAX_PAGE_HASH)
        if (self.layers is None) != (self.heads is None):
            raise StorageKeyError("a model shard key names both its layers and its heads")
        if self.layers is not None:
            if self.shard != (0, 1, 0, 1, 0, 1):
                raise StorageKeyError("a model shard key names model ranges, not a rank's place")
            for name, rng, top in (("layers", self.layers, MAX_LAYERS), ("heads", self.heads, MAX_HEADS)):
                if not isinstance(rng, tuple) or len(rng) != 2:
                    raise StorageKeyError(f"{name} must be a (first, last) tuple, got {rng!r}")
                _check_int(f"first of {name}", rng[0], 0, top)
                _check_int(f"last of {name}", rng[1], rng[0], top)

    def encode(self) -> str:
        """The versioned, filesystem-safe form, e.g. ``v1/n_llama/3/0of4/00ab...`` (kept with the
        key after the first call: a key is immutable)."""
        encoded = self.__dict__.get("_encoded")
        if encoded is not None:
            return encoded  # type: ignore[no-any-return]
        if self.layers is not None and self.heads is not None:
            encoded = (
                f"{SHARD_KEY_FORMAT}/{_encode_namespace(self.namespace)}/{self.layout_version}"
                f"/l{self.layers[0]}-{self.layers[1]}.h{self.heads[0]}-{self.heads[1]}/{self.page_hash:016x}"
            )
        else:
            stage = f"/p{self.pp_rank}of{self.pp_size}" if self.pp_size > 1 else ""
            context = f"/c{self.cp_rank}of{self.cp_size}" if self.cp_size > 1 else ""
            encoded = (
                f"{KEY_FORMAT}/{_encode_namespace(self.namespace)}/{self.layout_version}{stage}{context}"
                f"/{self.tp_rank}of{self.tp_size}/{self.page_hash:016x}"
            )
        self.__dict__["_encoded"] = encoded  # not a field: equality, hash and repr ignore it
        return encoded

    @property
    def shard(self) -> Shard:
        """The slice of the page this key holds: tensor rank, stage and context rank with their sizes."""
        return Shard(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.cp_rank, self.cp_size)

    @classmethod
    def decode(cls, encoded: str) -> StorageKey:
        """Parse an ``encode()`` string; raises :class:`StorageKeyError` for anything else."""
        if not isinstance(encoded, str):
            raise StorageKeyError(f"encoded key must be a str, got {type(encoded).__name__}")
        m = _ENCODED.fullmatch(encoded) or _ENCODED_SHARD.fullmatch(encoded)
        if m is None:
            raise StorageKeyError(f"not a valid encoded storage key: {encoded[:80]!r}")
        if m["plain"] is not None:
            namespace = m["plain"]
        else:
            try:
                namespace = bytes.fromhex(m["hex"]).decode("utf-8")
            except UnicodeDecodeError:
                raise StorageKeyError(f"namespace in {encoded[:80]!r} is not UTF-8") from None
        if m.re is _ENCODED_SHARD:
            ranges = {"layers": (int(m["l0"]), int(m["l1"])), "heads": (int(m["h0"]), int(m["h1"]))}
            key = cls(namespace, int(m["layout"]), 0, 1, int(m["hash"], 16), **ranges)
        else:
            stage = (int(m["stage"]), int(m["stages"])) if m["stages"] is not None else (0, 1)
            context = (int(m["cp"]), int(m["cps"])) if m["cps"] is not None else (0, 1)
            key = cls(namespace, int(m["layout"]), int(m["rank"]), int(m["size"]), int(m["hash"], 16), *stage, *context)
        # Only the canonical spelling is accepted, so one key has exactly one encoded form.
        if key.encode() != encoded:
            raise StorageKeyError(f"non-canonical encoded storage key: {encoded[:80]!r}")
        return key
