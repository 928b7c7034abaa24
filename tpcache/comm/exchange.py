"""Small setup-time exchanges over a torch.distributed group, without pickle or numpy.

``torch.distributed``'s ``*_object`` collectives need numpy and unpickle what peers send; setup only
needs a few JSON values, so they travel as uint8 tensors through plain ``all_gather``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def require_group(capacity: int) -> None:
    """The checks every torch-backed transport makes before touching the group."""
    from tpcache.comm.collective import CollectiveError

    if not (dist.is_available() and dist.is_initialized()):
        raise CollectiveError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")


def group_backend(group: Any, device: torch.device | None) -> str:
    """The backend that will carry tensors on ``device`` ('gloo', 'nccl', ...) in ``group``."""
    backend = str(dist.get_backend(group))
    if "," not in backend and ":" not in backend:
        return backend
    # A mixed backend string such as "cpu:gloo,cuda:nccl": pick by the device the tensors live on.
    wanted = "cuda" if device is not None and device.type == "cuda" else "cpu"
    for part in backend.split(","):
        dev, _, name = part.partition(":")
        if dev == wanted:
            return name
    return backend


def group_device(group: Any, device: torch.device | str | int | None = None) -> torch.device:
    """The device for tensors exchanged on ``group``: CUDA for NCCL, else CPU unless told otherwise."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = None if device is None else torch.device(device)
    if group_backend(group, dev) == "nccl":
        return dev if dev is not None else torch.device("cuda", torch.cuda.current_device())
    return dev if dev is not None else torch.device("cpu")


def all_gather_json(value: Any, group: Any = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), indexed by group rank. A collective call."""
    dev = device if device is not None else group_device(group)
    payload = json.dumps(value, sort_keys=True).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[:n].cpu().tolist())) for b, n in zip(bufs, lengths, strict=True)]
