"""Request streams for replays and benchmarks: Mooncake-format traces and a seeded generator."""

from tpcache.workload.trace import Request, load_trace, request_tokens
from tpcache.workload.synthetic import SyntheticWorkload

__all__ = ["Request", "SyntheticWorkload", "load_trace", "request_tokens"]
