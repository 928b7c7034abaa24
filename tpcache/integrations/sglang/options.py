"""What ``--radix-cache-backend tpcache`` serves of SGLang's configuration (pure: no SGLang import)."""

from __future__ import annotations

POLICIES = ("lru", "lfu", "fifo")


def refusal(
    *,
    hybrid_swa: bool,
    hybrid_ssm: bool,
    page_size: int,
    eagle: bool,
    hicache: bool,
    disabled: bool,
    eviction_policy: str,
) -> str | None:
    """Why this backend cannot serve SGLang's configuration, in one line (None: it can)."""
    flag = "--radix-cache-backend tpcache"
    if hybrid_swa or hybrid_ssm:
        kind = "sliding-window" if hybrid_swa else "Mamba"
        return f"{flag} serves full-attention models only; this model has {kind} layers (use SGLang's own cache)"
    if page_size <= 1:
        return f"{flag} needs --page-size > 1 (a tpcache page is a run of SGLang KV indices; 16 is typical)"
    if eagle:
        return f"{flag} does not serve EAGLE speculative decoding (bigram keys) yet"
    if hicache:
        return f"{flag} replaces HiCache: drop --enable-hierarchical-cache"
    if disabled:
        return f"{flag} is a prefix cache: drop --disable-radix-cache"
    if eviction_policy not in POLICIES:
        return f"{flag} evicts by {', '.join(POLICIES)}; got --radix-eviction-policy {eviction_policy}"
    return None


FAULTS_ENV = "TPCACHE_SGLANG_FAULTS"
FAULTS = ("diverge", "kill")


def parse_faults(text: str) -> dict[str, dict[str, int]]:
    """The test-only faults of ``TPCACHE_SGLANG_FAULTS`` (empty: none), by kind, each
    ``{"rank": R, "first_token": T}``: right after TP rank R caches a request whose tokens start
    with T, ``diverge`` makes it apply, once, one operation the other ranks do not (an extra lock
    and release: the ranks' trees differ and the next round must close the cache), and ``kill``
    makes its scheduler process SIGKILL itself (the other ranks' next round must end the group).
    Mistakes: one line."""
    import json

    if not text.strip():
        return {}
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{FAULTS_ENV} is not JSON: {exc}") from None
    shape = '{"diverge" or "kill": {"rank": R, "first_token": T}, ...}'
    if not isinstance(spec, dict) or not spec or not set(spec) <= set(FAULTS):
        raise ValueError(f"{FAULTS_ENV} must be {shape}, got {text!r}")
    faults = {}
    for kind, fault in spec.items():
        if (
            not isinstance(fault, dict)
            or set(fault) != {"rank", "first_token"}
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fault.values())
        ):
            raise ValueError(f"{FAULTS_ENV}: {kind} needs exactly rank and first_token, ints >= 0, got {fault!r}")
        faults[kind] = dict(fault)
    return faults


HOST_ENV = "TPCACHE_SGLANG_HOST_PAGES"


def parse_host_pages(text: str) -> int:
    """``TPCACHE_SGLANG_HOST_PAGES``: the size of tpcache's host tier, in pages of ``--page-size``
    tokens (0 or unset: no host tier). Mistakes: one line."""
    text = text.strip()
    if not text:
        return 0
    try:
        pages = int(text)
    except ValueError:
        pages = -1
    if pages < 0:
        raise ValueError(f"{HOST_ENV} must be a whole number of pages >= 0 (0: no host tier), got {text!r}")
    return pages


STORAGE_ENV = "TPCACHE_SGLANG_STORAGE"


def parse_storage(text: str, host_pages: int) -> str | None:
    """``TPCACHE_SGLANG_STORAGE``: the directory of tpcache's file store (its storage tier; each TP
    rank keeps its shard in ``rank<R>`` under it), or unset: no storage tier. The store is read and
    written through the host tier, so it needs ``TPCACHE_SGLANG_HOST_PAGES`` > 0. Mistakes: one line."""
    import os

    text = text.strip()
    if not text:
        return None
    if not os.path.isabs(text) or (os.path.exists(text) and not os.path.isdir(text)):
        raise ValueError(f"{STORAGE_ENV} must be an absolute path of a directory (the file store), got {text!r}")
    if host_pages <= 0:
        raise ValueError(f"{STORAGE_ENV} is read and written through the host tier: set {HOST_ENV} > 0")
    return text
