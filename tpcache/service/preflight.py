"""Checks of the machine a configuration will run on, made before any rank allocates or binds.

``launcher local`` runs them once for all its ranks before spawning any; each rank runs its own
share again (under torchrun nothing ran before it) and the ranks compare results and settings
right after the group forms (``process.agree``). Every problem is one line that names the setting
as its source spells it, the value and what would work.

What is checked: the group's shape fits the number of ranks (``pp_size x tp_size``, and the model's
layers and KV heads split evenly over them), the client endpoint's and the metrics ports are free,
the storage directory can be created and written (nothing is created: a failed start leaves the
disk as it found it) and no running group holds it, a shared store's servers accept connections,
the ready file's directory exists, and the
memory the KV pools need (computed from each rank's layout and the pool sizes) is available on
this host.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from tpcache.comm.parallel import Shard
from tpcache.io.memory import available_memory, format_bytes
from tpcache.io.storage.url import parse_storage_url
from tpcache.service.config import (
    DEFAULT,
    ConfigError,
    Resolved,
    ServiceConfig,
    SettingError,
    events_endpoints,
    spelling,
)


@dataclass(frozen=True)
class PoolBytes:
    """Bytes one rank's KV pools take (zero when metadata only: no layout, no bytes)."""

    page_bytes: int
    device: int
    host: int

    @classmethod
    def of(cls, config: ServiceConfig, world: int) -> PoolBytes:
        """For one rank of a group of ``world`` ranks (its slice of the model's layout)."""
        layout = config.rank_layout(world)
        if layout is None:
            return cls(0, 0, 0)
        page = layout.page_bytes
        # The engine keeps a one-slot host pool even without a host tier (copies need a target).
        return cls(page, page * config.device_pages, page * max(config.host_pages, 1))


def check_memory(
    resolved: Resolved,
    ranks_on_host: int,
    *,
    device_on_host: bool = True,
    available: int | None = None,
    world: int | None = None,
) -> None:
    """Raise ConfigError when the pools of ``ranks_on_host`` ranks (of ``world``, default all of
    them) do not fit in available memory."""
    config = resolved.config
    pools = PoolBytes.of(config, ranks_on_host if world is None else world)
    per_rank = pools.host + (pools.device if device_on_host else 0)
    need = per_rank * ranks_on_host
    have = available_memory() if available is None else available
    if not need or have is None or need <= have:
        return
    tiers = [f"host tier {max(config.host_pages, 1):,} pages"]
    if device_on_host:
        tiers.insert(0, f"device tier {config.device_pages:,} pages")
    raise ConfigError(
        f"not enough memory for the KV pools: {ranks_on_host} rank(s) on this host x ({' + '.join(tiers)}) x "
        f"{format_bytes(pools.page_bytes)} a page ({_layout_text(config)}) = {format_bytes(need)}, but this machine "
        f"has {format_bytes(have)} available; lower --device-pages or --host-pages"
    )


def _layout_text(config: ServiceConfig) -> str:
    return config.kv_layout or f"{config.model_layout} over the group"


def check_device_memory(resolved: Resolved, free_bytes: int, world: int) -> None:
    """Raise ConfigError when this rank's device tier does not fit in the GPU's free memory."""
    config = resolved.config
    pools = PoolBytes.of(config, world)
    if pools.device > free_bytes:
        raise ConfigError(
            f"not enough GPU memory for the device tier: {config.device_pages:,} pages x "
            f"{format_bytes(pools.page_bytes)} ({_layout_text(config)}) = {format_bytes(pools.device)}, but the GPU "
            f"has {format_bytes(free_bytes)} free; lower --device-pages"
        )


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (as the servers bind it, with SO_REUSEADDR), or None."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_ports(resolved: Resolved, ranks: range, world: int | None = None) -> None:
    """The client endpoint and the event stream's (rank 0) and each of ``ranks``' metrics port must be free."""
    config, sources = resolved.config, resolved.sources
    world = ranks.stop if world is None else world
    if 0 in ranks:
        check_events_ports(resolved)
    if 0 in ranks and config.endpoint.startswith("tcp://"):
        parsed = urlparse(config.endpoint)
        if parsed.port:
            why = port_in_use(parsed.hostname or "127.0.0.1", parsed.port)
            if why:
                raise ConfigError(
                    f"{spelling('endpoint', config.endpoint, sources['endpoint'])}: cannot bind port {parsed.port} "
                    f"({why}); choose another port, or port 0 for a free one"
                )
    if config.metrics_port:
        last = config.metrics_port + world - 1
        where = spelling("metrics_port", config.metrics_port, sources["metrics_port"])
        if last > 65535:
            raise ConfigError(f"{where}: rank {world - 1} would serve on port {last}, past 65535")
        for rank in ranks:
            port = config.metrics_port + rank
            why = port_in_use("127.0.0.1", port)
            if why:
                raise ConfigError(
                    f"{where}: port {port} (rank {rank}'s metrics: the port + its rank) cannot be bound on "
                    f"127.0.0.1 ({why}); choose a port P with P..P+{world - 1} free, or 0 (off)"
                )


def check_events_ports(resolved: Resolved) -> None:
    """The event stream's PUB and replay ports (rank 0 binds them) must be free."""
    config, sources = resolved.config, resolved.sources
    try:
        pub, replay = events_endpoints(config)
    except SettingError as exc:
        raise exc.where(sources.get(exc.name, DEFAULT)) from None
    where = spelling("events_endpoint", config.events_endpoint, sources["events_endpoint"])
    for endpoint, what in ((pub, "the event stream"), (replay, "its replay")):
        if not endpoint.startswith("tcp://"):
            continue
        parsed = urlparse(endpoint)
        if not parsed.port:
            continue
        host = parsed.hostname or "127.0.0.1"
        why = port_in_use("0.0.0.0" if host == "*" else host, parsed.port)
        if not why:
            continue
        if endpoint is pub:
            raise ConfigError(
                f"{where}: cannot bind port {parsed.port} for {what} ({why}); choose another port, or port 0 for a "
                "free one"
            )
        if config.events_replay_endpoint:
            replay_where = spelling(
                "events_replay_endpoint", config.events_replay_endpoint, sources["events_replay_endpoint"]
            )
            raise ConfigError(
                f"{replay_where}: cannot bind port {parsed.port} ({why}); choose another port, or port 0 for a free one"
            )
        raise ConfigError(
            f"{where}: cannot bind port {parsed.port} for its replay (the port + 1) ({why}); choose a port P with "
            "P and P+1 free, set events_replay_endpoint, or use port 0 for free ones"
        )


def check_writable_dir(path: Path) -> str | None:
    """Why ``path`` could not be created (if missing) and written, or None. Creates nothing: a
    start that fails its checks leaves the disk as it found it. The deepest part of the path that
    exists must be a directory this process can write in (a probe file, removed at once)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "it is not a directory" if existing == path else f"{existing} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".tpcache-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = "" if existing == path else f" in {existing}"
        return f"cannot create files{where}: {exc.strerror or exc}"
    return None


def lock_held(path: Path) -> bool:
    """Whether another process holds the file tier's ``flock`` on ``path`` (a running rank)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: nobody uses that directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock, if it took one
    return False


def check_paths(resolved: Resolved, ranks: range, world: int | None = None) -> None:
    config, sources = resolved.config, resolved.sources
    world = ranks.stop if world is None else world
    location = config.storage_location()
    spec = parse_storage_url(location) if location else None
    if spec is not None and spec.backend == "file":
        name = "storage_dir" if config.storage_dir else "storage_url"
        where = spelling(name, getattr(config, name), sources[name])
        group = config.group(world)
        if config.model_id:  # the model layout: every rank writes the first free of its shard's directories
            why = check_writable_dir(Path(spec.location) / "model")
            if why:
                raise ConfigError(f"{where}: cannot write the storage tier there ({why}); give a writable directory")
        for rank in () if config.model_id else ranks:
            rank_dir = Path(spec.location) / f"rank{rank}"
            why = check_writable_dir(rank_dir)
            if why:
                raise ConfigError(f"{where}: cannot write the storage tier there ({why}); give a writable directory")
            shard_dir = rank_dir / Shard(*group.place(rank)).label
            if lock_held(shard_dir / "LOCK"):
                raise ConfigError(
                    f"{where}: in use by a running group ({shard_dir} is locked by another process); stop that "
                    "group or give another directory"
                )
    if config.ready_file and 0 in ranks:
        parent = Path(config.ready_file).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            where = spelling("ready_file", config.ready_file, sources["ready_file"])
            raise ConfigError(f"{where}: its directory {parent} does not exist or is not writable")


STORE_CONNECT_TIMEOUT_S = 3.0


def store_addresses(location: str) -> list[tuple[str, str, int]]:
    """(what, host, port) of each server a shared store's URL names: the Redis server; the
    Mooncake master and its HTTP metadata service. Empty for the file tier."""
    spec = parse_storage_url(location)
    if spec.backend == "redis":
        parts = urlparse(spec.location)
        return [("the Redis server", parts.hostname or "127.0.0.1", parts.port or 6379)]
    if spec.backend != "mooncake":
        return []
    host, _, port = spec.location.rpartition(":")
    out = [("the Mooncake master", host.strip("[]"), int(port))]
    metadata = urlparse(str(spec.settings.get("metadata", "")))
    if metadata.scheme == "http" and metadata.hostname:
        out.append(("the Mooncake metadata service", metadata.hostname, metadata.port or 80))
    return out


def connect_problem(host: str, port: int, timeout_s: float = STORE_CONNECT_TIMEOUT_S) -> str | None:
    """Why a TCP connection to ``host:port`` fails (nothing listens, no route, no answer), or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


def check_store(resolved: Resolved) -> None:
    """A shared store's servers accept connections (the ranks would otherwise find out one by one,
    after start-up); what they answer is the backend's business once the ranks open it."""
    config, sources = resolved.config, resolved.sources
    if not config.storage_url:
        return
    for what, host, port in store_addresses(config.storage_url):
        why = connect_problem(host, port)
        if why:
            where = spelling("storage_url", config.storage_url, sources["storage_url"])
            raise ConfigError(f"{where}: cannot reach {what} at {host}:{port} ({why}); start it or correct the URL")


def preflight(
    resolved: Resolved, ranks: range, ranks_on_host: int, *, device_on_host: bool = True, world: int | None = None
) -> None:
    """Every machine check for ``ranks`` (the ranks this process answers for) of a group of
    ``world`` ranks, ``ranks_on_host`` of them on this host. Raises ConfigError."""
    world = ranks.stop if world is None else world
    check_group(resolved, world)
    check_ports(resolved, ranks, world)
    check_paths(resolved, ranks, world)
    check_store(resolved)
    check_memory(resolved, ranks_on_host, device_on_host=device_on_host, world=world)


def check_group(resolved: Resolved, world: int) -> None:
    """The group's shape fits ``world`` ranks and splits the model's layout evenly."""
    try:
        resolved.config.group(world)
        resolved.config.rank_layout(world)
    except SettingError as exc:
        raise exc.where(resolved.sources.get(exc.name, DEFAULT)) from None
