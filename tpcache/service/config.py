"""Service configuration: one frozen dataclass, the same on every rank.

Every field carries its help text and what values it allows; the launcher builds its command line
(``--round-timeout-s``), its environment names (``TPCACHE_ROUND_TIMEOUT_S``) and its config-file
keys (``round_timeout_s``) from the field's name, so each setting has one name in all three and
the sources can never drift apart. Precedence: command line > environment > file > defaults.
A setting's unit is part of its name where it has one (``_s``, ``_bytes``, ``_tokens``, ``_pages``).

Every value is checked here before any rank starts; an error names the setting as its source
spells it (``--device-pages 0``, ``TPCACHE_DEVICE_PAGES=0``, ``device_pages = 0 in c.toml``),
the value and what is allowed. Unknown ``TPCACHE_*`` variables and unknown file keys are errors
with the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tpcache.comm.parallel import GroupShapeError, ParallelGroup
from tpcache.comm.store import LISTEN_FD_ENV, is_loopback_host
from tpcache.core import CacheConfig, backend
from tpcache.core.config import HOST_MODES, WRITE_POLICIES
from tpcache.core.treecore.eviction import POLICIES
from tpcache.io.memory import format_bytes

ENV_PREFIX = "TPCACHE_"
# TPCACHE_* variables that are not settings: the launcher's hand-over to its ranks, a transport
# switch, a debug trace of the sequenced ops and the tests' fault injection (TPCACHE_FAULT_*).
RESOLVED_ENV = "TPCACHE_RESOLVED_CONFIG"
TRACE_OPS_ENV = "TPCACHE_TRACE_OPS"  # a folder: every rank writes the ops it applies to rank<r>.ops there
INTERNAL_ENV = frozenset((RESOLVED_ENV, "TPCACHE_NO_FUTEX", LISTEN_FD_ENV, TRACE_OPS_ENV))
INTERNAL_ENV_PREFIXES = ("TPCACHE_FAULT_",)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TRANSPORTS = ("auto", "shm", "torch")
CONFIG_SUFFIXES = (".toml", ".json", ".yaml", ".yml")

# Where a value came from, as the start-up block prints it.
DEFAULT, ENVIRONMENT, COMMAND_LINE = "default", "environment", "command line"


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsafe; the message names the setting."""


def _opt(default: Any, help: str, **extra: Any) -> Any:
    """A setting. ``extra``: ``choices``, ``min``, ``max``, ``unit="bytes"`` (accepts 64GiB),
    ``any_case`` (choices match in any case), ``metavar`` (the option's placeholder), ``secret``
    (never printed), ``rank_local`` (may differ between ranks: paths, addresses)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServiceConfig:
    # --- client endpoint and security
    endpoint: str = _opt(
        "tcp://127.0.0.1:5555",
        "ZMQ endpoint rank 0 binds for clients (ROUTER); port 0 picks a free port. "
        "Binding a non-loopback address needs --allow-remote and --secret.",
        rank_local=True,
    )
    allow_remote: bool = _opt(False, "allow binding a non-loopback client endpoint (needs --secret)", rank_local=True)
    secret: str = _opt(
        "",
        "shared secret clients must send in hello before any other op (prefer the TPCACHE_SECRET "
        "environment variable: a command line is visible to other users)",
        secret=True,
        rank_local=True,
    )
    internal_host: str = _opt(
        "127.0.0.1",
        "address each rank binds its internal fan-out socket on (loopback unless --allow-remote); "
        "every internal frame carries a MAC under a key the group draws at startup",
        rank_local=True,
    )
    # --- cache
    page_size: int = _opt(16, "tokens per page", min=1, max=1 << 16)
    device_pages: int = _opt(4096, "pages in the device tier (L1)", min=1)
    host_pages: int = _opt(0, "pages in the host tier (L2); 0 disables it", min=0)
    host_mode: str = _opt(
        "cache",
        "cache: host pages are a cached tier (L2) that serves hits; buffer: host slots only stage storage "
        "reads on their way to device and backups on their way to storage (needs a storage tier, --host-pages "
        "and write_through or write_through_selective)",
        choices=HOST_MODES,
    )
    write_policy: str = _opt("write_through", "when device pages are backed up to host", choices=WRITE_POLICIES)
    write_through_threshold: int = _opt(2, "hits before write_through_selective backs a page up", min=1)
    retention_cap_tokens: int = _opt(-1, "evictable device tokens kept when idle; -1 unlimited", min=-1)
    eviction_policy: str = _opt("lru", "eviction policy", choices=tuple(POLICIES))
    namespace: str = _opt("", "namespace salt of page hashes (separate models must not share pages)")
    mirror_release: bool = _opt(True, "release durable host mirrors of device pages under host pressure")
    kv_layout: str = _opt(
        "",
        "KV page layout of one rank, L<layers>xH<kv heads per rank>xD<head dim>:<dtype>, e.g. L32xH8xD128:bf16 "
        "(the form hello and stats report); empty: metadata only (no KV bytes; copies complete at once)",
        metavar="LAYOUT",
    )
    model_layout: str = _opt(
        "",
        "KV page layout of the whole model (every layer, every KV head), same syntax as --kv-layout, e.g. "
        "L32xH8xD128:bf16: each rank holds its stage's layers and its tensor rank's heads (instead of --kv-layout)",
        metavar="LAYOUT",
    )
    model_id: str = _opt(
        "",
        "the model's name in a shared store (checkpoint and revision, e.g. llama-3-8b@main); with --model-layout "
        "and a storage tier, pages are stored as shards of the model's KV heads and layers, which groups of any "
        "TP or PP size of the same model read. Empty: storage keys name each rank's place (its group's shape)",
        metavar="NAME",
    )
    # --- the group: pipeline stages x tensor ranks
    pp_size: int = _opt(
        1,
        "pipeline-parallel stages; each stage's ranks hold its contiguous share of the layers. Rank r is stage "
        "r // tp_size, tensor rank r mod tp_size",
        min=1,
        max=1 << 16,
    )
    tp_size: int = _opt(
        0,
        "tensor-parallel ranks per stage, each holding its share of the KV heads; 0: the world size / pp_size. "
        "pp_size x tp_size must equal the number of ranks",
        min=0,
        max=1 << 16,
    )
    storage_dir: str = _opt(
        "",
        "directory of the storage tier (L3, needs --kv-layout or --model-layout); rank r uses DIR/rank<r>; empty: off",
        rank_local=True,
    )
    storage_url: str = _opt(
        "",
        "storage tier (L3, needs --kv-layout) as a URL: file:///PATH (what --storage-dir means), "
        "mooncake://MASTER:PORT?metadata=http://HOST:PORT/metadata, redis://HOST:PORT/DB; settings as query "
        "parameters (docs/guides/storage.md); empty: off",
        rank_local=True,
    )
    storage_bytes: int = _opt(
        1 << 30, "capacity of the storage tier per rank (units allowed: 64GiB)", min=1, unit="bytes"
    )
    # --- rounds and transport
    transport: str = _opt("auto", "round transport (auto: shared memory when possible)", choices=TRANSPORTS)
    round_timeout_s: float = _opt(30.0, "seconds a round waits for every rank before the cache fails closed", min=0.001)
    heartbeat_s: float = _opt(1.0, "an idle leader runs a round at least this often (detects dead ranks)", min=0.001)
    max_batch: int = _opt(1024, "most client requests applied in one round", min=1)
    max_pending_per_client: int = _opt(4096, "requests one client may have in flight before OVERLOADED", min=1)
    max_connections: int = _opt(
        1024,
        "client connections rank 0 serves at once; each request on a connection past it is answered "
        "OVERLOADED (naming this setting) and the connection is closed",
        min=1,
        max=1 << 16,
    )
    max_unread_reply_bytes: int = _opt(
        0,
        "reply bytes rank 0 may hold for all client connections together (queued, or sent and not yet read); "
        "past it a large reply is refused OVERLOADED and the connection with the most unread bytes is closed; "
        "0: auto, 1/16 of the host's memory, at most 256 MiB (units allowed: 64MiB)",
        min=0,
        unit="bytes",
    )
    # --- leases
    lease_ttl_s: float = _opt(
        600.0,
        "seconds a lease may go unused (no request names it) before rank 0 releases it; 0 = never. "
        "Set it above your longest request. A client's leases are also released when it disconnects",
        min=0.0,
    )
    max_leases_per_client: int = _opt(4096, "leases one connection may hold before lock answers OVERLOADED", min=1)
    max_leases: int = _opt(65536, "leases all clients together may hold before lock answers OVERLOADED", min=1)
    # --- storage reads
    storage_key: str = _opt(
        "",
        "deployment secret (16 characters or more) every instance sharing the storage holds: each stored "
        "record carries a keyed MAC under it and one whose MAC does not verify is a miss; empty: records are "
        "checksummed, not authenticated (prefer TPCACHE_STORAGE_KEY or --storage-key-file: a command line is "
        "visible to other users)",
        secret=True,
        rank_local=True,
    )
    storage_key_file: str = _opt(
        "", "file whose first line is the storage key (instead of --storage-key)", rank_local=True, metavar="PATH"
    )
    storage_prefetch: bool = _opt(
        True,
        "with a storage tier: lock also looks the rest of its prefix up in storage and reads what "
        "every rank holds to host (the reply waits for the lookup); a request may choose otherwise; "
        "set_config changes it at runtime",
    )
    # --- failure
    broken_group_exit_s: float = _opt(
        2.0,
        "after the round's collective failed (a rank died or stalled past --round-timeout-s) the group "
        "cannot agree again: rank 0 keeps answering (CACHE_CLOSED: restart needed) for this long, "
        "then every rank exits with code 4 so that torchrun --max-restarts restarts the group; "
        "negative: keep answering until stopped",
    )
    # --- operations
    metrics_port: int = _opt(
        0, "/metrics, /health, /ready on 127.0.0.1:PORT+rank; 0 = off", min=0, max=65535, rank_local=True
    )
    ready_file: str = _opt("", "rank 0 writes {endpoint, pids, ...} as JSON here once serving", rank_local=True)
    log_level: str = _opt("INFO", "logging level (to stderr)", choices=LOG_LEVELS, any_case=True, rank_local=True)
    tree_core: str = _opt(
        backend.NAME,
        "the cache core's implementation: native (the C extension, where built) or reference (pure Python, "
        "the same decisions, slower); chosen once when a rank starts",
        choices=backend.CHOICES,
        rank_local=True,
    )
    # --- the KV-event stream (rank 0)
    events_endpoint: str = _opt(
        "",
        "rank 0 publishes what each round changed (pages stored and removed per tier, clears) on this ZMQ PUB "
        "endpoint in vLLM's KV-event encoding: a port (binds 127.0.0.1:PORT), tcp://HOST:PORT or ipc://PATH; "
        "port 0 picks a free port; empty: off",
        rank_local=True,
    )
    events_replay_endpoint: str = _opt(
        "",
        "the event stream's replay endpoint (ROUTER: replays, snapshots, the group's identity), same forms; "
        "empty: the events port + 1 on the same host (a free port when the events port is 0)",
        rank_local=True,
    )
    events_topic: str = _opt("kv-events", "ZMQ topic of the event batches (the digests go on topic tpcache-digest)")
    events_model: str = _opt("", "model name the event stream reports in the group's identity")
    events_replay_batches: int = _opt(10_000, "event batches the replay endpoint keeps", min=1)
    events_replay_mib: int = _opt(64, "MiB of event batches the replay endpoint keeps at most", min=1)
    events_batch_ms: float = _opt(
        20.0,
        "rounds that follow an event batch by less than this many milliseconds go into one batch, sent once it "
        "is due (fewer messages under load); 0: a batch after every round that changed something",
        min=0.0,
    )
    events_digest_every: int = _opt(64, "publish a digest of the stream's pages every this many batches", min=1)
    events_snapshot_max_pages: int = _opt(
        4_000_000,
        "largest snapshot (pages over all tiers) the replay endpoint sends; larger: refused",
        min=1,
    )

    def validate(self) -> None:
        """Raise ConfigError (a SettingError naming the setting) for any value not allowed."""
        for f in dataclasses.fields(self):
            _check_range(f, getattr(self, f.name))
        if self.tree_core == "native" and not backend.BUILT:
            raise SettingError("tree_core", "native", "the native extension was not built here; use reference")
        if self.storage_dir and self.storage_url:
            raise SettingError(
                "storage_url", self.storage_url, "give storage_dir or storage_url, not both (storage_dir D is file://D)"
            )
        if self.kv_layout and self.model_layout:
            raise SettingError(
                "model_layout", self.model_layout, "give kv_layout (one rank's) or model_layout (the model's), not both"
            )
        if self.model_id:
            self._check_model_id()
        if self.storage_location() and not (self.kv_layout or self.model_layout):
            name = "storage_dir" if self.storage_dir else "storage_url"
            raise SettingError(
                name, getattr(self, name), "needs kv_layout or model_layout: the storage tier stores page bytes"
            )
        if self.storage_url:
            from tpcache.io.storage.url import StorageURLError, parse_storage_url

            try:
                parse_storage_url(self.storage_url)
            except StorageURLError as exc:
                raise SettingError("storage_url", self.storage_url, str(exc)) from None
        self.storage_secret()
        check_endpoint(self.endpoint, self.allow_remote, self.secret)
        events_endpoints(self)
        if not is_loopback_host(self.internal_host) and not self.allow_remote:
            raise SettingError(
                "internal_host",
                self.internal_host,
                "is not a loopback address: pass --allow-remote to let ranks on other hosts reach the internal channel",
            )
        if self.kv_layout:
            parse_kv_layout(self.kv_layout, self.page_size)
        if self.model_layout:
            self.rank_layout(self.pp_size * max(self.tp_size, 1))
        if self.host_mode == "buffer":
            if not self.storage_location():
                raise SettingError("host_mode", self.host_mode, "needs a storage tier (storage_dir or storage_url)")
            if not self.host_pages:
                raise SettingError("host_mode", self.host_mode, "needs host_pages >= 1 (the staging slots)")
            if self.write_policy == "write_back":
                raise SettingError(
                    "host_mode", self.host_mode, "stages writes as pages are written: use write_through(_selective)"
                )
        elif self.storage_location() and not self.host_pages:
            raise SettingError(
                "host_pages",
                self.host_pages,
                "must be > 0 with a storage tier: pages reach storage and come back from it through the host tier",
            )

    def _check_model_id(self) -> None:
        if not self.model_layout:
            raise SettingError(
                "model_id", self.model_id, "needs model_layout (the whole model's layout; kv_layout is one rank's)"
            )
        from tpcache.io.storage.keys import StorageKey, StorageKeyError

        try:
            StorageKey(self.model_id, 0, 0, 1, 0)
        except StorageKeyError as exc:
            raise SettingError("model_id", self.model_id, str(exc)) from None

    def storage_secret(self) -> bytes | None:
        """The storage key's bytes (None: records are checksummed, not authenticated). A
        SettingError names the setting, never the key."""
        if self.storage_key and self.storage_key_file:
            raise SettingError(
                "storage_key_file", self.storage_key_file, "give storage_key or storage_key_file, not both"
            )
        if self.storage_key_file:
            try:
                text = Path(self.storage_key_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise SettingError(
                    "storage_key_file",
                    self.storage_key_file,
                    f"cannot be read: {getattr(exc, 'strerror', None) or exc}",
                ) from None
            key, name, shown = (text.splitlines() or [""])[0].strip(), "storage_key_file", self.storage_key_file
        elif self.storage_key:
            key, name, shown = self.storage_key, "storage_key", "***"
        else:
            return None
        if len(key.encode()) < 16:
            raise SettingError(name, shown, "the storage key must be at least 16 bytes (a deployment secret)")
        return key.encode()

    def group(self, world_size: int) -> ParallelGroup:
        """The group's shape for ``world_size`` ranks; a SettingError names the size that does not fit."""
        name = "tp_size" if self.tp_size else "pp_size"
        try:
            return ParallelGroup.of_world(world_size, self.pp_size, self.tp_size)
        except GroupShapeError as exc:
            raise SettingError(name, getattr(self, name), str(exc)) from None

    def rank_layout(self, world_size: int) -> Any:
        """This group's per-rank ``KVLayout`` (None: metadata only): ``kv_layout`` as written, or each
        rank's slice of ``model_layout`` (its stage's layers, its tensor rank's heads)."""
        if self.kv_layout:
            return parse_kv_layout(self.kv_layout, self.page_size)
        if not self.model_layout:
            return None
        from tpcache.io.errors import KVLayoutError

        model = parse_kv_layout(self.model_layout, self.page_size, "model_layout")
        group = self.group(world_size)
        try:
            layout = type(model).from_model(
                model.num_layers,
                model.heads_per_rank,
                model.head_dim,
                group.tp_size,
                model.dtype,
                self.page_size,
                pp_size=group.pp_size,
            )
        except KVLayoutError as exc:
            raise SettingError("model_layout", self.model_layout, f"{exc} ({group.name})") from None
        if self.model_id:  # the shared storage layout: every rank must hold whole shards
            from tpcache.io.storage.sharded import ModelShape, ShardLayoutError

            shard = group.place(0)
            try:
                ModelShape.of_rank(self.model_id, layout, shard).ranges(layout, shard)
            except ShardLayoutError as exc:
                raise SettingError("model_layout", self.model_layout, f"{exc} ({group.name})") from None
        return layout

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            page_size=self.page_size,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            host_mode=self.host_mode,
            write_policy=self.write_policy,
            write_through_threshold=self.write_through_threshold,
            retention_cap_tokens=self.retention_cap_tokens,
            eviction_policy=self.eviction_policy,
            namespace=self.namespace,
            storage=bool(self.storage_location()),
            mirror_release=self.mirror_release,
        )

    def storage_location(self) -> str:
        """The storage tier's URL ('' when off); ``storage_dir`` D is ``file://D``."""
        if self.storage_dir:
            from tpcache.io.storage.url import file_url

            return file_url(self.storage_dir)
        return self.storage_url

    def group_settings(self) -> dict[str, Any]:
        """The settings every rank must hold equal (compared across ranks at start-up). Paths and
        addresses may differ between hosts; whether the storage tier is on may not."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("rank_local")}
        shared["storage"] = bool(self.storage_location())
        return shared

    def replace(self, **changes: Any) -> ServiceConfig:
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(ServiceConfig)}


class SettingError(ConfigError):
    """One setting's value is not allowed. ``str()`` names it as the default spelling; the
    launcher rewrites it with ``where()`` once it knows which source the value came from."""

    def __init__(self, name: str, value: Any, allowed: str) -> None:
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{name} = {value!r}: {allowed}")

    def where(self, source: str) -> ConfigError:
        return ConfigError(f"{spelling(self.name, self.value, source)}: {self.allowed}")


def spelling(name: str, value: Any, source: str) -> str:
    """How ``source`` writes this setting: ``--device-pages 0``, ``TPCACHE_DEVICE_PAGES=0``, ..."""
    shown = "***" if FIELDS.get(name) is not None and FIELDS[name].metadata.get("secret") else value
    if name == "storage_url" and isinstance(value, str):
        shown = _mask_password(value)
    if source == COMMAND_LINE:
        return f"{flag_name(name)} {shown}"
    if source == ENVIRONMENT:
        return f"{env_name(name)}={shown}"
    if source.startswith("file "):
        return f"{name} = {shown!r} in {source.removeprefix('file ')}"
    return f"{name} = {shown!r} ({source})"


def _mask_password(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part shown as ``***``."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    user, at, host = netloc.rpartition("@")
    if not sep or not at or ":" not in user:
        return url
    return f"{scheme}://{user.split(':', 1)[0]}:***@{host}{slash}{tail}"


def _check_range(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise SettingError(f.name, value, f"must be one of {', '.join(meta['choices'])}")
    low, high = meta.get("min"), meta.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        kind = "a number" if isinstance(f.default, float) else "an integer"
        if high is None:
            bound = f">= {low}"
        elif low is None:
            bound = f"<= {high}"
        else:
            bound = f"in [{low}, {high}]"
        raise SettingError(f.name, value, f"must be {kind} {bound} ({meta['help'].split(';')[0]})")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def check_endpoint(endpoint: str, allow_remote: bool, secret: str) -> None:
    """Raise ConfigError unless ``endpoint`` is a loopback TCP address, an ipc:// path, or a
    remote address explicitly allowed and protected by a shared secret."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return
    parsed = urlparse(endpoint)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise SettingError("endpoint", endpoint, "must look like tcp://HOST:PORT or ipc://PATH")
    if is_loopback_host(parsed.hostname):
        return
    if not allow_remote:
        raise SettingError(
            "endpoint",
            endpoint,
            "is not a loopback address: pass --allow-remote (and a shared secret) to accept clients from other hosts",
        )
    if len(secret) < 16:
        raise ConfigError("a non-loopback endpoint needs a shared secret of at least 16 characters (TPCACHE_SECRET)")


# ---------------------------------------------------------------------- KV layout and sizes

_LAYOUT = re.compile(r"L(\d+)xH(\d+)xD(\d+):([A-Za-z0-9_]+)")
LAYOUT_SYNTAX = "L<layers>xH<kv heads per rank>xD<head dim>:<dtype>, e.g. L32xH8xD128:bf16"
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8"}


def parse_kv_layout(text: str, page_size: int, setting: str = "kv_layout") -> Any:
    """A ``KVLayout`` from ``L32xH8xD128:bf16`` (imports torch); errors name ``setting``."""
    from tpcache.io.errors import KVLayoutError
    from tpcache.io.kv_pool import KVLayout

    match = _LAYOUT.fullmatch(text.strip())
    if match is None:
        syntax = LAYOUT_SYNTAX if setting == "kv_layout" else LAYOUT_SYNTAX.replace(" per rank", "")
        raise SettingError(setting, text, f"must be {syntax}")
    layers, heads, head_dim, dtype = match.groups()
    try:
        return KVLayout(int(layers), int(heads), int(head_dim), dtype, page_size)
    except (KVLayoutError, ValueError, TypeError) as exc:
        raise SettingError(setting, text, str(exc)) from None


def format_kv_layout(layout: Any) -> str:
    """The one spelling of a layout, the one ``parse_kv_layout`` reads: ``L32xH8xD128:bf16``."""
    dtype = str(layout.dtype).removeprefix("torch.")
    dtype = _SHORT_DTYPES.get(dtype, dtype)
    return f"L{layout.num_layers}xH{layout.heads_per_rank}xD{layout.head_dim}:{dtype}"


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with a unit: ``1073741824``, ``64GiB``, ``1.5 TB`` (KB, MB,
    GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE.fullmatch(str(value))
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(value)
    number = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    return int(number)


# ---------------------------------------------------------------------- sources


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = type(f.default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if f.metadata.get("unit") == "bytes":
            return parse_size(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        if f.metadata.get("any_case"):
            return next((c for c in f.metadata["choices"] if c.lower() == value.lower()), value)
        return value
    except (TypeError, ValueError):
        what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        if f.metadata.get("unit") == "bytes":
            what = "a size in bytes, with an optional unit (64GiB, 500MB)"
        raise ConfigError(f"{spelling(f.name, value, source)}: must be {what}") from None


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def load_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML, JSON or YAML file (by extension); keys are the settings' names
    (``round_timeout_s``). A file may keep them under a ``tpcache`` table. Unknown keys are errors
    that name the file and the nearest setting."""
    p = Path(path)
    if p.suffix.lower() not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"config file {p}: unknown format {p.suffix or '(no extension)'!r}; use {', '.join(CONFIG_SUFFIXES)}"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - each parser has its own error type; all mean "not valid"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {p} is not valid {suffix.lstrip('.').upper()}: {first}") from None
    if isinstance(data, dict) and isinstance(data.get("tpcache"), dict) and len(data) == 1:
        data = data["tpcache"]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of settings (key = value)")
    for key in data:
        if key not in FIELDS:
            raise ConfigError(f"config file {p}: unknown setting {str(key)!r}{_suggest(str(key), list(FIELDS))}")
    return dict(data)


def check_environment(env: Mapping[str, str]) -> None:
    """Every ``TPCACHE_*`` variable must name a setting: a misspelt one is an error, not ignored."""
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX) or key in INTERNAL_ENV or key.startswith(INTERNAL_ENV_PREFIXES):
            continue
        name = key.removeprefix(ENV_PREFIX).lower()
        if name not in FIELDS or env_name(name) != key:
            close = difflib.get_close_matches(name, list(FIELDS), n=1, cutoff=0.6)
            hint = f"; did you mean {env_name(close[0])}?" if close else " (python -m launcher serve --help lists them)"
            raise ConfigError(f"environment variable {key} is not a tpcache setting{hint}")


@dataclass(frozen=True)
class Resolved:
    """A checked configuration and, per setting, where its value came from."""

    config: ServiceConfig
    sources: dict[str, str]

    def to_json(self) -> str:
        return json.dumps({"values": dataclasses.asdict(self.config), "sources": self.sources})

    @classmethod
    def from_json(cls, text: str) -> Resolved:
        data = json.loads(text)
        config = ServiceConfig(**data["values"])
        config.validate()
        return cls(config, dict(data["sources"]))


def resolve(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    *,
    file: str | Path | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = DEFAULT,
) -> Resolved:
    """Merge the sources (command line > environment > file > ``defaults`` > the fields' own
    defaults), coerce and validate every value. Raises ConfigError naming the setting as its
    source spells it."""
    env = os.environ if env is None else env
    check_environment(env)
    if file is not None and file_values is None:
        file_values = load_file(file)
    file_source = f"file {file}" if file is not None else "file"
    values: dict[str, Any] = {}
    sources = {name: DEFAULT for name in FIELDS}
    env_values = {name: env[env_name(name)] for name in FIELDS if env_name(name) in env}
    for source, mapping in (
        (defaults_source, defaults or {}),
        (file_source, file_values or {}),
        (ENVIRONMENT, env_values),
        (COMMAND_LINE, cli or {}),
    ):
        for name, value in mapping.items():
            if value is None:
                continue
            if name not in FIELDS:
                raise ConfigError(f"{source}: unknown setting {name!r}{_suggest(name, list(FIELDS))}")
            values[name] = _coerce(FIELDS[name], value, source)
            sources[name] = source
    config = ServiceConfig(**values)
    try:
        config.validate()
    except SettingError as exc:
        raise exc.where(sources.get(exc.name, DEFAULT)) from None
    return Resolved(config, sources)


def build_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> ServiceConfig:
    """``resolve(...).config``: the merged, checked configuration."""
    return resolve(cli, env, file_values).config


def describe_sources(resolved: Resolved) -> list[str]:
    """The effective settings grouped by where they came from, one line per source."""
    config, groups = resolved.config, {}
    for name, f in FIELDS.items():
        value = "***" if f.metadata.get("secret") and getattr(config, name) else getattr(config, name)
        if f.metadata.get("unit") == "bytes":
            value = format_bytes(int(value))
        groups.setdefault(resolved.sources.get(name, DEFAULT), []).append(f"{name}={value}")
    order = sorted(groups, key=lambda s: (s == DEFAULT, s != COMMAND_LINE, s != ENVIRONMENT, s))
    return [f"({source}) {' '.join(groups[source])}" for source in order]


# ---------------------------------------------------------------------- the KV-event stream


def _events_endpoint(name: str, value: str) -> str:
    if value.isdigit():
        if int(value) > 65535:
            raise SettingError(name, value, "a port is at most 65535")
        return f"tcp://127.0.0.1:{value}"
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    parsed = urlparse(value)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise SettingError(name, value, "must be a port, tcp://HOST:PORT or ipc://PATH")
    return value


def events_endpoints(config: ServiceConfig) -> tuple[str, str]:
    """The event stream's (PUB, replay) endpoints, or ("", "") when it is off; a SettingError for a
    value that is not a port, tcp://HOST:PORT or ipc://PATH, or for topics a subscriber cannot tell apart."""
    if not config.events_endpoint:
        if config.events_replay_endpoint:
            raise SettingError("events_replay_endpoint", config.events_replay_endpoint, "needs events_endpoint")
        return "", ""
    digest = "tpcache-digest"
    topic = config.events_topic
    if not topic or topic.startswith(digest) or digest.startswith(topic):
        raise SettingError(
            "events_topic", topic, f"must be non-empty and neither a prefix of {digest!r} nor start with it"
        )
    pub = _events_endpoint("events_endpoint", config.events_endpoint)
    if config.events_replay_endpoint:
        replay = _events_endpoint("events_replay_endpoint", config.events_replay_endpoint)
    elif pub.startswith("ipc://"):
        replay = pub + "-replay"
    else:
        head, _, port = pub.rpartition(":")
        replay = f"{head}:{int(port) + 1 if int(port) else 0}"
    if replay == pub and not pub.endswith(":0"):
        raise SettingError("events_replay_endpoint", config.events_replay_endpoint, "must differ from events_endpoint")
    return pub, replay
