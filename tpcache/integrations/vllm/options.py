"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Names and checks are the service's (``tpcache.service.config.ServiceConfig``) wherever the setting
is the same: ``host_pages``, ``storage_dir``, ``storage_bytes``, ``transport``,
``round_timeout_s``, ``metrics_port``, ``namespace``, ``eviction_policy``. What only an engine
needs is added here. An empty dict works: the host tier is sized from free memory, no storage.

Every TP rank starts from the same options, but what a rank reads from its own machine (the memory
it has available) differs from rank to rank and moment to moment. The ranks agree on it before the
cache is built (``agree_host_tier``: the least reading of any rank), and compare the settings that
must be equal, so every rank builds the same cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpcache.core import backend
from tpcache.core.treecore.eviction import make_policy
from tpcache.io.memory import available_memory, format_bytes
from tpcache.io.storage.record import MIN_KEY_BYTES
from tpcache.service.config import ConfigError, ServiceConfig

DEFAULT_HOST_FRACTION = 0.1  # of the least memory any TP rank has available at start, shared by the ranks
DEFAULT_HOST_CAP_BYTES = 8 << 30  # per rank
LOAD_MODES = ("auto", "sync", "async")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ConnectorOptions:
    host_pages: int = _opt(0, "pages in the host tier (L2) per rank; 0: from host_bytes")
    host_bytes: int = _opt(
        0,
        "bytes of the host tier per rank; 0 with host_pages 0: a tenth of the least memory any TP rank has "
        "available at start, shared by the ranks, at most 8 GiB a rank",
    )
    storage_dir: str = _opt("", "directory of the storage tier (L3), shared by restarts; empty: off")
    storage_bytes: int = _opt(1 << 30, "capacity of the storage tier per rank, in bytes")
    transport: str = _opt("auto", "round transport: auto (shared memory when possible), shm, torch")
    round_timeout_s: float = _opt(30.0, "seconds a round waits for every rank before the cache fails closed")
    metrics_port: int = _opt(0, "Prometheus metrics on 127.0.0.1:PORT+rank; 0 = off")
    namespace: str = _opt("", "namespace salt of page hashes; the model's name is always added")
    eviction_policy: str = _opt("lru", "host eviction policy")
    lookup_timeout_s: float = _opt(
        2.0,
        "seconds a lookup waits for its storage prefetch before it reports what has landed, timed by the "
        "scheduler and applied by every rank in the same engine step; 2: far longer than reading a prompt's "
        "pages from a healthy disk takes, so a storage hit is not given up, yet a stuck storage tier delays "
        "a request only briefly",
    )
    lookup_timeout_rounds: int = _opt(
        0, "engine steps a lookup waits for its storage prefetch at most, besides lookup_timeout_s; 0 = no cap"
    )
    tree_core: str = _opt(
        "",
        "the cache core: native or reference (pure Python); it is chosen when tpcache is imported, by the "
        "environment variable TPCACHE_TREE_CORE of vLLM's processes; empty: whatever that chose",
    )
    reopen: bool = _opt(True, "after the cache fails closed, reopen it by an agreed flush (all ranks together)")
    copy_by_layer: bool | str = _opt(
        "auto",
        "true: copy by attention layer during vLLM's forward pass (a copy thread; a side CUDA stream on a "
        "GPU); false: every copy after the forward pass; auto: true where vLLM's KV is on a GPU, false on CPU",
    )
    load_mode: str = _opt(
        "auto",
        "sync: a hit is copied into vLLM's blocks before the forward pass of the step that schedules it; "
        "async: the request waits out of the batch until every rank agreed its load; auto: sync where vLLM "
        "recomputes a failed sync load (one KV cache group), else async",
    )
    fault_injection: dict = field(
        default_factory=dict, metadata={"help": "tests only: faults to inject (tpcache.integrations.vllm.faults)"}
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse and check; raises ConfigError naming the offending option."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown option(s) {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            if name == "copy_by_layer" and not isinstance(value, bool) and value != "auto":
                raise ConfigError(
                    f'kv_connector_extra_config: copy_by_layer must be true, false or "auto", got {value!r}'
                )
            if name == "copy_by_layer":
                values[name] = value
                continue
            if name == "load_mode" and value not in LOAD_MODES:
                raise ConfigError(
                    f'kv_connector_extra_config: load_mode must be "auto", "sync" or "async", got {value!r}'
                )
            kind = dict if name == "fault_injection" else type(fields[name].default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
                raise ConfigError(f"kv_connector_extra_config: {name} must be {kind.__name__}, got {value!r}")
            values[name] = value
        options = cls(**values)
        options.validate()
        return options

    def validate(self, page_size: int = 16) -> None:
        if self.host_pages < 0 or self.host_bytes < 0:
            raise ConfigError("host_pages and host_bytes must be >= 0")
        if self.lookup_timeout_rounds < 0:
            raise ConfigError("lookup_timeout_rounds must be >= 0")
        if not self.lookup_timeout_s > 0:
            raise ConfigError(f"lookup_timeout_s must be > 0 (seconds), got {self.lookup_timeout_s}")
        if self.tree_core:
            try:
                backend.require(self.tree_core, "kv_connector_extra_config: tree_core")
            except backend.TreeCoreError as exc:
                raise ConfigError(str(exc)) from None
        try:
            make_policy(self.eviction_policy)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        try:
            # The service's checks for the settings it shares (kv_layout stands in for the engine's).
            self.service_config(page_size, max(self.host_pages, 1), "L1xH1xD1:fp32").validate()
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None

    def service_config(self, page_size: int, host_pages: int, kv_layout: str) -> ServiceConfig:
        return ServiceConfig(
            page_size=page_size,
            device_pages=1,  # the engine owns the device pages; the service's checks want a pool
            host_pages=host_pages,
            eviction_policy=self.eviction_policy,
            namespace=self.namespace,
            kv_layout=kv_layout,
            storage_dir=self.storage_dir,
            storage_bytes=self.storage_bytes,
            transport=self.transport,
            round_timeout_s=self.round_timeout_s,
            metrics_port=self.metrics_port,
        )

    def group_settings(self) -> dict[str, Any]:
        """The settings every TP rank must hold equal, as the service compares them: the storage
        directory may be another path on another host, but storage is on for all or none."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in RANK_LOCAL}
        shared["storage"] = bool(self.storage_dir)
        return shared


# May differ between ranks: a path or a port of the rank's own host, test faults aimed at one rank, and the
# tree core (both make the same decisions).
RANK_LOCAL = ("storage_dir", "metrics_port", "fault_injection", "tree_core")


@dataclass(frozen=True)
class HostTier:
    """The host tier every rank of the group builds, and where its size came from."""

    pages: int
    page_bytes: int
    source: str  # "host_pages", "host_bytes" or "free memory"
    readings: tuple[int | None, ...] = ()  # each rank's available memory (free memory only)
    agreed_available: int | None = None  # the least of the readings

    def describe(self) -> str:
        """The host tier for the start-up line."""
        size = f"host tier {self.pages} pages of {format_bytes(self.page_bytes)}"
        total = format_bytes(self.pages * self.page_bytes)
        if self.source != "free memory":
            return f"{size} ({total}, from {self.source})"
        least = "unknown" if self.agreed_available is None else format_bytes(self.agreed_available)
        each = ", ".join(f"rank {r} {'unknown' if v is None else format_bytes(v)}" for r, v in enumerate(self.readings))
        return (
            f"{size} ({total}: a tenth of the least memory available on any rank, {least}, shared by "
            f"{len(self.readings)} ranks, at most {format_bytes(DEFAULT_HOST_CAP_BYTES)} a rank; available: {each})"
        )


STORAGE_KEY_ENV = "TPCACHE_STORAGE_KEY"  # the storage key, as the service reads it: never an option
SHORT_KEY = "short"  # a rank's key fingerprint when its key is too short to use


def storage_key_fingerprint(secret: str) -> str:
    """What a rank tells the others of its storage key: a fingerprint that does not reveal it ("":
    no key; ``SHORT_KEY``: one too short to use), so the ranks can tell whether they hold the same."""
    if not secret:
        return ""
    raw = secret.encode()
    if len(raw) < MIN_KEY_BYTES:
        return SHORT_KEY
    return hashlib.blake2b(raw, digest_size=8, person=b"tpcache-keyfp").hexdigest()


def rank_facts(options: ConnectorOptions, kv_layout: str, storage_key: str | None = None) -> dict[str, Any]:
    """What one rank contributes to the agreement before the cache is built (JSON). ``storage_key``:
    the rank's storage key (None: ``TPCACHE_STORAGE_KEY`` from its environment), checked here and
    given only as a fingerprint, with storage on."""
    if storage_key is None:
        storage_key = os.environ.get(STORAGE_KEY_ENV, "")
    return {
        "settings": options.group_settings(),
        "available": available_memory(),
        "kv_layout": kv_layout,
        "storage_key": storage_key_fingerprint(storage_key) if options.storage_dir else "",
    }


def agree_host_tier(options: ConnectorOptions, gathered: Sequence[Mapping[str, Any]], page_bytes: int) -> HostTier:
    """The host tier of a group from every rank's ``rank_facts`` (rank order), the same on every
    rank: an explicit ``host_pages`` or ``host_bytes``, else a tenth of the least memory any rank
    has available, shared by the ranks and capped per rank. Raises ConfigError (one line, each
    rank's value) when settings that must be equal differ, the KV page layouts or the storage keys
    do, or a rank's storage key is too short."""
    world = len(gathered)
    differ = []
    names = gathered[0]["settings"]
    for name in names:
        values = [item["settings"].get(name) for item in gathered]
        if any(v != values[0] for v in values):
            differ.append(f"{name} ({', '.join(f'rank {r} {json.dumps(v)}' for r, v in enumerate(values))})")
    if differ:
        raise ConfigError(
            "kv_connector_extra_config: settings that must be equal on every TP rank differ: " + "; ".join(differ)
        )
    _agree_storage_key([item.get("storage_key", "") for item in gathered])
    layouts = [item["kv_layout"] for item in gathered]
    if any(v != layouts[0] for v in layouts):
        each = ", ".join(f"rank {r} {v}" for r, v in enumerate(layouts))
        raise ConfigError(f"the KV page layout differs across TP ranks ({each}): tpcache needs the same on every rank")
    if options.host_pages:
        return HostTier(options.host_pages, page_bytes, "host_pages")
    if options.host_bytes:
        return HostTier(max(1, options.host_bytes // page_bytes), page_bytes, "host_bytes")
    readings = tuple(item["available"] for item in gathered)
    known = [v for v in readings if v is not None]
    least = min(known) if known else None
    budget = min(
        int((least or DEFAULT_HOST_CAP_BYTES) * DEFAULT_HOST_FRACTION) // max(world, 1), DEFAULT_HOST_CAP_BYTES
    )
    return HostTier(max(1, budget // page_bytes), page_bytes, "free memory", readings, least)


def _agree_storage_key(prints: list[str]) -> None:
    """Every rank holds a usable storage key and the same one, or none does (each rank's fingerprint
    in rank order). The error names the ranks, never a key or its fingerprint."""
    short = [r for r, v in enumerate(prints) if v == SHORT_KEY]
    if short:
        ranks = ", ".join(f"rank {r}" for r in short)
        raise ConfigError(
            f"{STORAGE_KEY_ENV}: the storage key must be at least {MIN_KEY_BYTES} bytes "
            f"(a deployment secret), the same on every TP rank; shorter on {ranks}"
        )
    if any(v != prints[0] for v in prints):
        names: dict[str, str] = {}  # fingerprint -> "key A", "key B", ... in the order ranks hold them
        for v in prints:
            if v and v not in names:
                names[v] = f"key {chr(ord('A') + len(names) % 26)}"
        each = ", ".join(f"rank {r} {names.get(v, 'unset')}" for r, v in enumerate(prints))
        raise ConfigError(f"{STORAGE_KEY_ENV}: the storage key must be the same on every TP rank; it differs ({each})")


def page_namespace(namespace: str, model: str) -> str:
    """The namespace salt of page hashes: the user's, and the model's name, so two models never
    share a page, in memory or in storage."""
    return f"{namespace}|vllm|{model}"


def model_identity(vllm_config: Any) -> tuple[str, str]:
    """The model's identity under vLLM, as the shard layout's model id, and in words: its name or
    path, revision, dtype, quantization and KV cache dtype. Two checkpoints that agree on all of
    these (and on the layout) cannot be told apart."""
    mc = vllm_config.model_config
    fields = {
        "model": str(mc.model),
        "revision": str(mc.revision or ""),
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": str(mc.quantization or ""),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
    }
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()
    shown = {"revision": "revision", "dtype": "dtype", "quantization": "quantization", "kv_cache_dtype": "KV cache"}
    words = fields["model"] + "".join(f", {shown[k]} {fields[k]}" for k in shown if fields[k] not in ("", "auto"))
    return f"vllm-{digest}", words


def unshared_reason(vllm_config: Any, num_groups: int) -> str:
    """Why the storage tier cannot take the model's shard layout under this vLLM configuration
    (``num_groups``: vLLM's KV cache groups), or ""."""
    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        return "pipeline stages under vLLM keep the per-rank layout"
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        return "context-parallel ranks each hold some of a page's tokens, not whole KV heads"
    if num_groups > 1:
        return f"a model with {num_groups} KV cache groups (sliding-window or Mamba layers) keeps the per-rank layout"
    return ""
