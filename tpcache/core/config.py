"""Configuration of the core: what every rank must hold identically.

Components beside the full-attention pages (a hybrid model's other layer kinds) are declared here:
a sliding-window component (``swa_window`` > 0) and a Mamba state component (``mamba_every`` != 0),
each with its own device and host pools. ``components()`` lists them in a fixed order; component 0
is always the full-attention pages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpcache.core import backend

WRITE_POLICIES = ("none", "write_through", "write_through_selective", "write_back")
# "cache": the host pool is a cached tier (L2). "buffer": host slots only stage storage reads on their
# way to device and backups on their way to storage; nothing is served from host (``staging.py``).
HOST_MODES = ("cache", "buffer")
# The most pages a device or host pool may hold: page ids and host slots are int32 wherever they are
# held (a walk's and a holding's arrays, a native node's fields).
POOL_PAGES_MAX = 2**31 - 1


@dataclass(frozen=True)
class ComponentSpec:
    """One component beside the full-attention pages.

    ``window_pages`` > 0: sliding-window data, one page per node; a hit needs the pages covering the
    last ``window_pages`` pages before its boundary. ``every`` != 0: a recurrent state per node where
    kept (every k-th page boundary, or -1: where an insert ends); a hit ends at a node with a state."""

    index: int
    name: str
    device_slots: int
    host_slots: int
    window_pages: int = 0
    every: int = 0

    @property
    def is_window(self) -> bool:
        return self.window_pages > 0


@dataclass(frozen=True)
class CacheConfig:
    """Sizes are in pages of ``page_size`` tokens. ``host_pages == 0`` disables the host tier."""

    page_size: int = 16
    device_pages: int = 1024
    host_pages: int = 0
    host_mode: str = "cache"  # one of HOST_MODES
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
    admission_max_deferrals: int = 32  # "try again" answers before a request is admitted with its device hit
    # Sliding-window attention layers: window in tokens (0: none), their own pools in pages.
    swa_window: int = 0
    swa_device_pages: int = 0
    swa_host_pages: int = 0
    swa_release_out_of_window: bool = True  # after each insert, free a request's SWA behind its window
    # Mamba (recurrent state) layers: where states are kept (0: none; k >= 1: at every k-th page
    # boundary; -1: only at the end of what each insert adds), the bytes of one state on a rank
    # (declared; the KV layout of the state pool must match), their own pools in states.
    mamba_every: int = 0
    mamba_state_bytes: int = 0
    mamba_device_states: int = 0
    mamba_host_states: int = 0
    # The device tier's pages belong to the engine's allocator (SGLang's KV pool): inserts adopt the
    # pages the engine wrote (``adopt``), eviction hands page ids back (``AdoptedPages.drain``), and
    # the core allocates none. ``device_pages`` bounds the page ids.
    device_adopt: bool = False

    def validate(self) -> None:
        backend.require()  # TPCACHE_TREE_CORE=native where it was not built: one line, no core
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.device_pages < 0 or self.host_pages < 0:
            raise ValueError("pool sizes must be >= 0")
        for name, pages in (("device_pages", self.device_pages), ("host_pages", self.host_pages)):
            if pages > POOL_PAGES_MAX:  # page ids are int32 wherever they are held
                raise ValueError(f"{name} must be at most {POOL_PAGES_MAX} (page ids are int32), got {pages}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {self.write_policy!r}; choose one of {WRITE_POLICIES}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        if min(self.prefetch_max_pages, self.prefetch_max_attempts) < 1 or self.prefetch_retry_rounds < 0:
            raise ValueError("prefetch_max_pages and prefetch_max_attempts must be >= 1, retry rounds >= 0")
        if self.prefetch_max_deferrals < 0 or self.admission_max_deferrals < 0:
            raise ValueError("prefetch_max_deferrals and admission_max_deferrals must be >= 0")
        if self.host_mode not in HOST_MODES:
            raise ValueError(f"unknown host mode {self.host_mode!r}; choose one of {HOST_MODES}")
        if self.host_mode == "buffer" and not (self.host_pages and self.storage):
            raise ValueError("host_mode 'buffer' stages storage reads and writes: it needs host_pages > 0 and storage")
        if self.host_mode == "buffer" and self.write_policy == "write_back":
            raise ValueError(
                "host_mode 'buffer' stages backups on their way to storage as pages are written "
                "(write_through or write_through_selective), not at eviction (write_back)"
            )
        if self.host_mode == "buffer" and (self.swa_window or self.mamba_every):
            raise ValueError("host_mode 'buffer' serves full-attention models only (no swa_window, no mamba_every)")
        if self.plan_mismatch_limit < 1:
            raise ValueError("plan_mismatch_limit must be >= 1")
        if self.retention_cap_tokens < -1:
            raise ValueError("retention_cap_tokens must be -1 (unlimited), 0 (none) or a token count")
        if self.swa_window < 0 or min(self.swa_device_pages, self.swa_host_pages) < 0:
            raise ValueError("swa_window and the SWA pool sizes must be >= 0")
        if self.swa_window and not self.swa_device_pages:
            raise ValueError("a sliding-window component needs swa_device_pages > 0")
        if self.mamba_every < -1 or min(self.mamba_device_states, self.mamba_host_states, self.mamba_state_bytes) < 0:
            raise ValueError("mamba_every must be -1 (end of each insert), 0 (none) or k >= 1; pool sizes >= 0")
        if self.mamba_every and not self.mamba_device_states:
            raise ValueError("a Mamba component needs mamba_device_states > 0")
        if self.device_adopt:
            self._validate_adopt()

    def _validate_adopt(self) -> None:
        if self.device_pages <= 0:
            raise ValueError("device_adopt needs device_pages > 0 (the engine's page ids are 0 .. device_pages-1)")
        if self.storage and (not self.host_pages or self.host_mode != "cache"):
            raise ValueError("device_adopt with storage reads and writes it through a host tier: set host_pages > 0")
        if self.host_pages and (self.host_mode != "cache" or self.write_policy == "write_back"):
            raise ValueError(
                "device_adopt backs pages up to host as they are cached: host_mode 'cache' with "
                "write_through or write_through_selective"
            )
        if self.components():
            raise ValueError("device_adopt serves full-attention models only (no swa_window, no mamba_every)")

    def components(self) -> tuple[ComponentSpec, ...]:
        """The components beside full attention, in a fixed order (index 1, 2, ...)."""
        out: list[ComponentSpec] = []
        if self.swa_window:
            pages = -(-self.swa_window // self.page_size)
            out.append(
                ComponentSpec(len(out) + 1, "swa", self.swa_device_pages, self.swa_host_pages, window_pages=pages)
            )
        if self.mamba_every:
            dev, host = self.mamba_device_states, self.mamba_host_states
            out.append(ComponentSpec(len(out) + 1, "mamba", dev, host, every=self.mamba_every))
        return tuple(out)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
