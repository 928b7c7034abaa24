"""The round's collective over torch.distributed: gloo on CPU, NCCL on GPU, on the caller's group.

Each call is exactly one ``all_reduce(MIN)`` of a preallocated int64 tensor of fixed shape
``capacity + 2``: ``[n, -n, v0 .. v(n-1), padding]``. The fixed shape keeps every rank's collective the
same size even if a rank's vector length diverged (a size mismatch inside gloo/NCCL is undefined
behaviour); the ``(n, -n)`` header then detects the divergence after the reduce.

Timeouts: the call never blocks much beyond ``timeout_s``. On gloo ``work.wait(timeout)`` returns or
raises in time (the op itself also carries the process group's timeout); on NCCL the host polls
``work.is_completed()`` (spin, then yield, then short sleeps) so a hung kernel cannot block the host,
and the result is only copied back once the op completed. torch.distributed does not say which peer
is missing, so ``CollectiveTimeout.missing_ranks`` is empty and the message says so.
"""

from __future__ import annotations

import datetime
import os
import time
from array import array
from typing import Any

import torch
import torch.distributed as dist

from tpcache.comm.collective import DEFAULT_CAPACITY, Collective, CollectiveError, CollectiveTimeout
from tpcache.comm.exchange import group_backend, group_device, require_group

_HEADER = 2  # (n, -n)


class TorchCollective(Collective):
    """``Collective`` on a torch.distributed process group (constructing it is a collective call)."""

    def __init__(
        self,
        group: Any = None,
        device: torch.device | str | int | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
        allow_any_thread: bool = False,
    ) -> None:
        require_group(capacity)
        dev = group_device(group, device)
        backend = group_backend(group, dev)
        if backend == "nccl" and dev.type != "cuda":
            raise ValueError(f"the NCCL backend needs a CUDA device, got {dev}")
        super().__init__(
            dist.get_rank(group),
            dist.get_world_size(group),
            backend,
            capacity=capacity,
            allow_any_thread=allow_any_thread,
        )
        self.group = group
        self.device = dev
        # The host frame and a tensor sharing its memory: writing the array is the fastest way in from
        # Python, and on CPU the reduce happens in place on it.
        self._frame = array("q", bytes(8 * (capacity + _HEADER)))
        self._host = torch.frombuffer(self._frame, dtype=torch.int64)
        self._tensor = self._host if dev.type == "cpu" else torch.zeros_like(self._host, device=dev)
        self._poll = dev.type == "cuda"
        self._check_capacity_agreed()

    def _check_capacity_agreed(self) -> None:
        """Every rank must use the same frame size, or the reduce itself is undefined: check once."""
        probe = torch.tensor([self.capacity, -self.capacity], dtype=torch.int64, device=self.device)
        dist.all_reduce(probe, op=dist.ReduceOp.MIN, group=self.group)
        low, neg_high = probe.tolist()
        if low != -neg_high:
            raise CollectiveError(
                f"ranks set up the {self.name} collective with different capacities "
                f"({low} to {-neg_high}); use one configuration on every rank"
            )

    def _allreduce_min(self, values: array, timeout_s: float) -> array:
        n = len(values)
        frame = self._frame
        frame[0] = n
        frame[1] = -n
        frame[_HEADER : _HEADER + n] = values
        if self._tensor is not self._host:
            self._tensor.copy_(self._host)
        try:
            work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            if self._poll:
                self._poll_until_done(work, timeout_s)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except CollectiveError:
            raise
        except Exception as exc:  # gloo/NCCL report timeouts and lost peers as RuntimeError subclasses
            raise self._timeout(timeout_s, f"{type(exc).__name__}: {exc}") from exc
        if self._tensor is not self._host:
            self._host.copy_(self._tensor)
        if frame[0] != -frame[1]:
            raise CollectiveError(
                f"round vector length differs across ranks (from {frame[0]} to {-frame[1]}); "
                "the ranks run different configurations"
            )
        return frame[_HEADER : _HEADER + n]  # a new array('q')

    def _poll_until_done(self, work: Any, timeout_s: float) -> None:
        """Wait for ``work`` without ever blocking the host past the deadline (spin, yield, sleep)."""
        start = time.perf_counter()
        deadline = start + timeout_s
        pause = 20e-6
        while not work.is_completed():
            now = time.perf_counter()
            if now >= deadline:
                raise self._timeout(timeout_s, "the all-reduce did not complete")
            if now - start < 50e-6:
                continue
            if now - start < 1e-3:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def _timeout(self, timeout_s: float, detail: str) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"{self.name} all-reduce on rank {self.rank} of {self.world_size} failed or did not complete "
            f"within {timeout_s:g} s ({detail}); torch.distributed does not report which ranks are "
            "missing: check the other ranks' logs"
        )
