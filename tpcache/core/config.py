"""Configuration of the core: what every rank must hold identically."""

from __future__ import annotations

from dataclasses import asdict, dataclass

WRITE_POLICIES = ("none", "write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes are in pages of ``page_size`` tokens. ``host_pages == 0`` disables the host tier."""

    page_size: int = 16
    device_pages: int = 1024
    host_pages: int = 0
    write_policy: str = "write_through"
    write_through_threshold: int = 2  # hits before write_through_selective backs a page up
    retention_cap_tokens: int = -1  # evictable device tokens kept when idle; -1 unlimited, 0 none
    eviction_policy: str = "lru"
    namespace: str = ""
    storage: bool = False  # back host pages up to the storage tier (L3)
    mirror_release: bool = True  # release durable host mirrors of device pages under host pressure
    plan_mismatch_limit: int = 3  # consecutive plan mismatches before a plan feature switches off
    prefetch_max_pages: int = 1024  # pages one storage prefetch looks up
    prefetch_max_attempts: int = 3  # storage lookups per request before it proceeds without
    prefetch_retry_rounds: int = 2  # rounds between attempts (paced, never a busy retry)
    prefetch_max_deferrals: int = 8  # rounds a prefetch may wait for host slots

    def validate(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.device_pages < 0 or self.host_pages < 0:
            raise ValueError("pool sizes must be >= 0")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {self.write_policy!r}; choose one of {WRITE_POLICIES}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        if min(self.prefetch_max_pages, self.prefetch_max_attempts) < 1 or self.prefetch_retry_rounds < 0:
            raise ValueError("prefetch_max_pages and prefetch_max_attempts must be >= 1, retry rounds >= 0")
        if self.prefetch_max_deferrals < 0:
            raise ValueError("prefetch_max_deferrals must be >= 0")
        if self.plan_mismatch_limit < 1:
            raise ValueError("plan_mismatch_limit must be >= 1")
        if self.retention_cap_tokens < -1:
            raise ValueError("retention_cap_tokens must be -1 (unlimited), 0 (none) or a token count")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
