"""tpcache speaks through vLLM's log handler.

vLLM configures one handler, on its ``vllm`` logger, in every process it starts (API server,
engine core, each worker); a logger under it prints the way vLLM's own lines do, with the process
name (``Worker_TP0``) in front. The connector logs to ``vllm.tpcache``, and the records of
tpcache's own loggers (``tpcache.round`` says why a cache closed) are passed on to it.
"""

from __future__ import annotations

import logging

LOGGER = "vllm.tpcache"


class _ToVllm(logging.Handler):
    """Hands a ``tpcache.*`` record to ``vllm.tpcache``, whose parent holds vLLM's handler."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(LOGGER).handle(record)


def speak_through_vllm() -> None:
    """Route tpcache's loggers to vLLM's handler, at vLLM's level, unless the user has given the
    ``tpcache`` logger handlers of their own. Idempotent."""
    ours = logging.getLogger("tpcache")
    if ours.handlers:
        return
    ours.addHandler(_ToVllm())
    ours.propagate = False  # vLLM's own logger does not propagate either: each line prints once
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.getLogger("vllm").getEffectiveLevel())
