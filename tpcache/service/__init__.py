"""The tpcache service: one rank process per GPU, rank 0 sequencing client requests over ZMQ.

Modules: ``config`` (ServiceConfig), ``handlers`` (apply one request to a TPCache), ``channels``
(the internal fan-out), ``leader`` (rank 0: front door, sequencing, replies after the round),
``follower`` (ranks 1..N-1), ``process`` (a rank's lifetime), ``metrics`` (Prometheus),
``buffers`` (registered KV buffers). Start it with ``python -m launcher``.
"""

from tpcache.service.config import ConfigError, ServiceConfig, build_config

__all__ = ["ConfigError", "ServiceConfig", "build_config"]
