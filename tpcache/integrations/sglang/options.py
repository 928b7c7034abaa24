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
