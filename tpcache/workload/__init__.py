"""Request streams for replays and benchmarks: Mooncake-format traces and a seeded generator."""

from tpcache.workload.synthetic import SyntheticWorkload
from tpcache.workload.trace import Request, load_trace, request_tokens

__all__ = ["Request", "SyntheticWorkload", "load_trace", "request_tokens"]
