"""Choose the round's transport: shared memory when all ranks share a host, else torch.distributed."""

from __future__ import annotations

import logging
from typing import Any

from tpcache.comm.collective import DEFAULT_CAPACITY, Collective

log = logging.getLogger("tpcache.comm")

TRANSPORTS = ("auto", "shm", "torch")


def make_collective(
    transport: str = "auto",
    group: Any = None,
    device: Any = None,
    *,
    capacity: int = DEFAULT_CAPACITY,
    shm_dir: str | None = None,
) -> Collective:
    """The round's ``Collective`` on ``group`` (a collective call: every rank of the group calls it).

    ``transport``: ``"shm"`` forces shared memory (raises ``ShmUnavailable`` if the ranks are not on
    one host or setup fails), ``"torch"`` forces torch.distributed (gloo on CPU, NCCL on GPU, on
    ``device``), ``"auto"`` takes shm when it can be set up and torch otherwise; every rank reaches the
    same choice. ``capacity`` is the most int64 values one round may carry and must match across ranks;
    ``shm_dir`` overrides where the shared-memory segment is created (default ``/dev/shm``).
    The choice is logged at INFO on ``tpcache.comm`` and readable as ``collective.name``.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown round transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    # Imported here so the simulation ring can use tpcache.comm without importing torch.
    from tpcache.comm.shm import ShmCollective, ShmUnavailable
    from tpcache.comm.torch_collective import TorchCollective

    collective: Collective
    if transport in ("auto", "shm"):
        try:
            options = {} if shm_dir is None else {"shm_dir": shm_dir}
            collective = ShmCollective(group, device=device, capacity=capacity, **options)
        except ShmUnavailable as exc:
            if transport == "shm":
                raise
            log.info("round transport: shared memory unavailable (%s); using torch.distributed", exc)
        else:
            log.info(
                "round transport: shm (rank %d of %d, segment %s)",
                collective.rank,
                collective.world_size,
                collective.segment_name,
            )
            return collective
    collective = TorchCollective(group, device, capacity=capacity)
    log.info("round transport: %s (rank %d of %d)", collective.name, collective.rank, collective.world_size)
    return collective
