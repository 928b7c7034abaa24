"""One ordered KV-event stream per group: rank 0 publishes what each round changed on each tier
(``publisher``), in vLLM's KV-event encoding with sequence numbers, replay and digests (``wire``);
``Subscriber`` is the reference consumer (a router's mirror, ``leading_pages``)."""

from tpcache.events.subscriber import Group, ReplayError, Subscriber

__all__ = ["Group", "ReplayError", "Subscriber"]
