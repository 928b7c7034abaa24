"""Service configuration: one frozen dataclass, the same on every rank.

Every field carries its help text; the launcher builds its command line, its ``TPCACHE_*``
environment names and its config-file keys from these fields, so the three sources can never
drift apart. Precedence: command line > environment > file > defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tpcache.core import CacheConfig
from tpcache.core.config import WRITE_POLICIES
from tpcache.dist.store import is_loopback_host

ENV_PREFIX = "TPCACHE_"


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsafe; the message names the option."""


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServiceConfig:
    # --- client endpoint and security
    endpoint: str = _opt(
        "tcp://127.0.0.1:5555",
        "ZMQ endpoint rank 0 binds for clients (ROUTER); port 0 picks a free port. "
        "Binding a non-loopback address needs --allow-remote and --secret.",
    )
    allow_remote: bool = _opt(False, "allow binding a non-loopback client endpoint (needs --secret)")
    secret: str = _opt(
        "",
        "shared secret clients must send in hello before any other op (prefer the TPCACHE_SECRET "
        "environment variable: a command line is visible to other users)",
        secret=True,
    )
    internal_host: str = _opt(
        "127.0.0.1",
        "address each rank binds its internal fan-out socket on (loopback unless --allow-remote); "
        "every internal frame carries a MAC under a key the group draws at startup",
    )
    # --- cache
    page_size: int = _opt(16, "tokens per page")
    device_pages: int = _opt(4096, "pages in the device tier (L1)")
    host_pages: int = _opt(0, "pages in the host tier (L2); 0 disables it")
    write_policy: str = _opt("write_through", f"when device pages are backed up to host: {', '.join(WRITE_POLICIES)}")
    write_through_threshold: int = _opt(2, "hits before write_through_selective backs a page up")
    retention_cap_tokens: int = _opt(-1, "evictable device tokens kept when idle; -1 unlimited")
    eviction_policy: str = _opt("lru", "eviction policy")
    namespace: str = _opt("", "namespace salt of page hashes (separate models must not share pages)")
    mirror_release: bool = _opt(True, "release durable host mirrors of device pages under host pressure")
    kv_layout: str = _opt(
        "",
        "KV page layout of one rank, 'layers=L,heads=H,head_dim=D,dtype=bf16'; empty: metadata only "
        "(no KV bytes; copies complete at once)",
    )
    storage_dir: str = _opt("", "directory of the storage tier (L3, needs --kv-layout); empty: off")
    storage_url: str = _opt(
        "",
        "storage tier (L3, needs --kv-layout) as a URL: file:///PATH (what --storage-dir means), "
        "mooncake://MASTER:PORT?metadata=http://HOST:PORT/metadata, redis://HOST:PORT/DB; settings as query "
        "parameters (README, 'Shared storage'); empty: off",
    )
    storage_bytes: int = _opt(1 << 30, "capacity of the storage tier per rank, in bytes")
    # --- rounds and transport
    transport: str = _opt("auto", "round transport: auto (shared memory when possible), shm, torch")
    round_timeout_s: float = _opt(30.0, "seconds a round waits for every rank before the cache fails closed")
    heartbeat_s: float = _opt(1.0, "an idle leader runs a round at least this often (detects dead ranks)")
    max_batch: int = _opt(1024, "most client requests applied in one round")
    max_pending_per_client: int = _opt(4096, "requests one client may have in flight before OVERLOADED")
    # --- leases
    lease_ttl_s: float = _opt(
        600.0,
        "seconds a lease may go unused (no request names it) before rank 0 releases it; 0 = never. "
        "Set it above your longest request. A client's leases are also released when it disconnects",
    )
    max_leases_per_client: int = _opt(4096, "leases one connection may hold before lock answers OVERLOADED")
    max_leases: int = _opt(65536, "leases all clients together may hold before lock answers OVERLOADED")
    # --- storage reads
    storage_prefetch: bool = _opt(
        True,
        "with a storage tier: lock also looks the rest of its prefix up in storage and reads what "
        "every rank holds to host (the reply waits for the lookup); a request may choose otherwise; "
        "set_config changes it at runtime",
    )
    # --- failure
    broken_group_exit_s: float = _opt(
        2.0,
        "after the round's collective failed (a rank died or stalled past --round-timeout) the group "
        "cannot agree again: rank 0 keeps answering (CACHE_CLOSED: restart needed) for this long, "
        "then every rank exits with code 4 so that torchrun --max-restarts restarts the group; "
        "negative: keep answering until stopped",
    )
    # --- operations
    metrics_port: int = _opt(0, "Prometheus metrics on 127.0.0.1:PORT+rank; 0 = off")
    ready_file: str = _opt("", "rank 0 writes {endpoint, pids, ...} as JSON here once serving")
    log_level: str = _opt("WARNING", "logging level: DEBUG, INFO, WARNING, ERROR")

    def validate(self) -> None:
        self.cache_config().validate()
        if self.transport not in ("auto", "shm", "torch"):
            raise ConfigError(f"transport must be auto, shm or torch, got {self.transport!r}")
        for name in ("round_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if self.max_batch < 1 or self.max_pending_per_client < 1:
            raise ConfigError("max_batch and max_pending_per_client must be >= 1")
        if self.lease_ttl_s < 0:
            raise ConfigError("lease_ttl_s must be >= 0 (0: leases never expire by age)")
        if self.max_leases_per_client < 1 or self.max_leases < 1:
            raise ConfigError("max_leases_per_client and max_leases must be >= 1")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.storage_dir and self.storage_url:
            raise ConfigError("give storage_dir or storage_url, not both (storage_dir D is storage_url file://D)")
        if self.storage_location() and not self.kv_layout:
            raise ConfigError("the storage tier needs kv_layout: it stores page bytes")
        if self.storage_url:
            from tpcache.io.storage.url import StorageURLError, parse_storage_url

            try:
                parse_storage_url(self.storage_url)
            except StorageURLError as exc:
                raise ConfigError(f"storage_url: {exc}") from None
        check_endpoint(self.endpoint, self.allow_remote, self.secret)
        if not is_loopback_host(self.internal_host) and not self.allow_remote:
            raise ConfigError(
                f"internal_host {self.internal_host} is not a loopback address: pass --allow-remote to let "
                "ranks on other hosts reach the internal channel"
            )
        if self.kv_layout:
            parse_kv_layout(self.kv_layout, self.page_size)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            page_size=self.page_size,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
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

    def public_dict(self) -> dict[str, Any]:
        """Every setting except secrets (for logs and stats)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("secret")}

    def replace(self, **changes: Any) -> ServiceConfig:
        return dataclasses.replace(self, **changes)


def check_endpoint(endpoint: str, allow_remote: bool, secret: str) -> None:
    """Raise ConfigError unless ``endpoint`` is a loopback TCP address, an ipc:// path, or a
    remote address explicitly allowed and protected by a shared secret."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return
    parsed = urlparse(endpoint)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ConfigError(f"endpoint must look like tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    if is_loopback_host(parsed.hostname):
        return
    if not allow_remote:
        raise ConfigError(
            f"endpoint {endpoint} is not a loopback address: pass --allow-remote (and a shared secret) "
            "to accept clients from other hosts"
        )
    if len(secret) < 16:
        raise ConfigError("a non-loopback endpoint needs a shared secret of at least 16 characters (TPCACHE_SECRET)")


def parse_kv_layout(text: str, page_size: int) -> Any:
    """A ``KVLayout`` from 'layers=L,heads=H,head_dim=D,dtype=bf16' (imports torch)."""
    from tpcache.io.kv_pool import KVLayout

    parts: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"kv_layout: {item!r} is not key=value")
        parts[key.strip()] = value.strip()
    unknown = parts.keys() - {"layers", "heads", "head_dim", "dtype"}
    if unknown or not {"layers", "heads", "head_dim"} <= parts.keys():
        raise ConfigError("kv_layout needs layers=, heads=, head_dim= and optionally dtype=")
    try:
        return KVLayout(
            int(parts["layers"]), int(parts["heads"]), int(parts["head_dim"]), parts.get("dtype", "bf16"), page_size
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"kv_layout {text!r}: {exc}") from None


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    kind = type(f.default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{source}: {f.name} must be a boolean, got {value!r}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {f.name} must be {kind.__name__}, got {value!r}") from None


FIELDS = {f.name: f for f in dataclasses.fields(ServiceConfig)}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def load_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML (``.toml``) or JSON file; keys are field names (dashes allowed).
    A TOML file may keep them under a ``[tpcache]`` table."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    try:
        if p.suffix == ".toml":
            import tomllib

            data: Any = tomllib.loads(text)
            data = data.get("tpcache", data)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table/object of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> ServiceConfig:
    """Merge the sources (command line > environment > file > defaults) and validate."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for source, mapping in (("config file", file_values or {}), ("environment", None), ("command line", cli or {})):
        if mapping is None:
            for name, f in FIELDS.items():
                if env_name(name) in env:
                    values[name] = _coerce(f, env[env_name(name)], f"environment {env_name(name)}")
            continue
        for name, value in mapping.items():
            if value is None:
                continue
            if name not in FIELDS:
                raise ConfigError(f"{source}: unknown setting {name!r}")
            values[name] = _coerce(FIELDS[name], value, source)
    config = ServiceConfig(**values)
    try:
        config.validate()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return config
