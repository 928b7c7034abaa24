"""Which vLLM the connector runs on: the hooks it overrides and the names it reads, checked once per
process before the connector class is built.

vLLM's KV connector API is marked experimental and changes between releases: a hook renamed, or a
parameter added to one the connector overrides, would otherwise surface as a ``TypeError`` deep in
an engine step. The check compares vLLM's own base class against the signatures below; when one is
missing or different, the connector refuses to start with one line naming it and the vLLM version.
A version the tests never ran on that passes the check starts with one warning.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from tpcache.integrations.vllm.logs import LOGGER

log = logging.getLogger(LOGGER)

# The vLLM releases the connector's test ring ran on.
TESTED_VERSIONS = ("0.32.0",)

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# KVConnectorBase_V1's hooks the connector overrides or calls: name -> parameters after self, in
# order ("**kwargs" for a variadic keyword parameter). vLLM calls an override the way its base
# declares it, so the base must declare exactly these.
CONNECTOR_HOOKS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    # scheduler side
    "bind_kv_cache_manager": ("kv_cache_manager",),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "get_external_cache_hit_sources": ("request", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "has_pending_push_work": (),
    "reset_cache": (),
    "get_kv_connector_stats": (),
    "take_events": (),
    # worker side
    "register_kv_caches": ("kv_caches",),
    "bind_connector_metadata": ("connector_metadata",),
    "handle_preemptions": ("kv_connector_metadata",),
    "start_load_kv": ("forward_context", "**kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "**kwargs"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_transfer_results": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "build_connector_worker_meta": (),
    "shutdown": (),
    # class methods (vLLM's stats logger calls them on the class)
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
}


@dataclass(frozen=True)
class Name:
    """A class, enum member or field the connector reads from vLLM: ``module:Class[.attr]``;
    ``field`` marks a dataclass field (an instance attribute the class does not carry itself)."""

    module: str
    path: str
    field: bool = False

    def __str__(self) -> str:
        return self.path


NAMES = (
    Name(BASE, "KVConnectorBase_V1"),
    Name(BASE, "KVConnectorMetadata"),
    Name(BASE, "KVConnectorRole.SCHEDULER"),
    Name(BASE, "KVConnectorWorkerMetadata.aggregate"),
    Name(BASE, "SupportsHMA.request_finished_all_groups"),
    Name(BASE, "KVConnectorTransferResults"),
    Name("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    Name("vllm.v1.kv_cache_interface", "RSWASpec"),
    Name("vllm.v1.kv_cache_interface", "SlidingWindowSpec"),
    Name("vllm.v1.metrics.cache_hit_source", "CacheHitSource.HOST"),
    Name("vllm.v1.metrics.cache_hit_source", "CacheHitSource.DISK"),
    Name("vllm.v1.outputs", "KVConnectorOutput.kv_connector_worker_meta", field=True),
    Name("vllm.v1.outputs", "KVConnectorOutput.finished_recving", field=True),
    Name("vllm.v1.outputs", "KVConnectorOutput.invalid_block_ids", field=True),
    Name("vllm.v1.outputs", "KVConnectorOutput.failed_recving", field=True),
    Name("vllm.config", "KVTransferConfig.kv_load_failure_policy", field=True),
    Name("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids"),
    Name("vllm.distributed.parallel_state", "get_tp_group"),
    Name("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats"),
    Name("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorPromMetrics"),
    Name("vllm.distributed.kv_events", "BlockStored"),
    Name("vllm.distributed.kv_events", "BlockRemoved"),
)


class VllmVersionError(RuntimeError):
    """This vLLM lacks a hook the connector needs (or declares it differently)."""


def vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 - a version we cannot read is reported as such
        return "(version unknown)"


def declared(fn: Any) -> tuple[str, ...]:
    """A callable's parameters after self / cls, as CONNECTOR_HOOKS writes them."""
    out = []
    for p in list(inspect.signature(fn).parameters.values()):
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        elif p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
        else:
            out.append(p.name)
    if out and out[0] in ("self", "cls"):
        out = out[1:]
    return tuple(out)


def hook_problems(base: type, hooks: dict[str, tuple[str, ...]] = CONNECTOR_HOOKS) -> list[str]:
    """What ``base`` lacks or declares differently, one phrase per hook, in the order of ``hooks``."""
    problems = []
    for name, params in hooks.items():
        fn = inspect.getattr_static(base, name, None)
        if fn is None:
            problems.append(f"has no {base.__name__}.{name}")
            continue
        fn = getattr(base, name)
        try:
            got = declared(fn)
        except (TypeError, ValueError):
            problems.append(f"has a {base.__name__}.{name} whose parameters cannot be read")
            continue
        if got != params:
            problems.append(f"declares {base.__name__}.{name}({', '.join(got)}), not ({', '.join(params)})")
    return problems


def name_problem(name: Name) -> str | None:
    """None when vLLM has ``name``, else what is missing."""
    try:
        obj: Any = importlib.import_module(name.module)
    except ImportError:
        return f"has no module {name.module} (for {name})"
    parts = name.path.split(".")
    for i, part in enumerate(parts):
        if name.field and i == len(parts) - 1:
            fields = getattr(obj, "__dataclass_fields__", None)
            if fields is not None and part in fields:
                return None
            if part in getattr(obj, "model_fields", {}) or part in getattr(obj, "__annotations__", {}):
                return None
            return f"has no {name}"
        if not hasattr(obj, part):
            return f"has no {'.'.join(parts[: i + 1])} (in {name.module})"
        obj = getattr(obj, part)
    return None


_checked: str | None = None


def check_vllm(base: type | None = None, names: tuple[Name, ...] = NAMES, version: str | None = None) -> str:
    """Refuse (``VllmVersionError``, one line) when this vLLM lacks a hook or name the connector
    uses; warn once when it passes but is not a tested version. Returns the version checked. The
    real check runs once per process; passing ``base`` checks that class instead (and again)."""
    global _checked
    own = base is None and version is None and names is NAMES
    if own and _checked is not None:
        return _checked
    version = vllm_version() if version is None else version
    problems = [p for p in map(name_problem, names) if p]
    if base is None and not problems:
        base = importlib.import_module(BASE).KVConnectorBase_V1
    if base is not None:
        problems += hook_problems(base)
    if problems:
        tested = ", ".join(TESTED_VERSIONS)
        raise VllmVersionError(
            f"TPCacheConnector cannot run on vLLM {version}: it {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + f"; versions tested: {tested}"
        )
    if version not in TESTED_VERSIONS:
        log.warning(
            "tpcache: vLLM %s is not a version the connector was tested on (%s); every hook it uses is present",
            version,
            ", ".join(TESTED_VERSIONS),
        )
    if own:
        _checked = version
    return version
