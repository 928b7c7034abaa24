"""The rendezvous store of a group: loopback only on one host, one key space per torchrun attempt.

``torch.distributed``'s TCPStore server listens on every interface whatever host it is given, so
any machine that can reach the port could read or set the group's keys. A group whose ranks all
run on this host needs none of that: rank 0 binds the listening socket to the loopback address
itself and hands it to the store (``master_listen_fd``); the other ranks connect as usual.

Under torchrun the agent's store outlives a restart of the workers, keys included: a restarted
rank could read a peer's address from the attempt before and connect to a port nobody listens
on. Each attempt therefore works under its own prefix (``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

# A launcher that starts the ranks itself (``launcher local``) binds rank 0's listening socket
# before it spawns them and hands it over by this variable (its fd number): a port picked free and
# bound later by the rank could be taken in between by any other process on the host.
LISTEN_FD_ENV = "TPCACHE_STORE_LISTEN_FD"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``localhost`` or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_store(host: str, port: int, world_size: int, rank: int, timeout_s: float) -> Any:
    """A TCPStore for a group whose rendezvous address ``host`` is a loopback address; rank 0's
    server listens on ``host:port`` only. Raises ValueError for a host that is not loopback."""
    import torch.distributed as dist

    if not is_loopback_host(host):
        raise ValueError(f"{host} is not a loopback address")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = _handed_over(host, port)
    try:
        if listener is None:
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(128, world_size))
        store = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno(), use_libuv=True
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now
    return store


def _handed_over(host: str, port: int) -> socket.socket | None:
    """The listening socket the launcher bound for ``host:port`` (``LISTEN_FD_ENV``), or None."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)  # once: nothing this rank starts inherits the claim
    if fd is None:
        return None
    listener = socket.socket(fileno=int(fd))
    bound = listener.getsockname()
    if (bound[0], bound[1]) != (host, port):
        listener.close()
        raise RuntimeError(f"the launcher handed over a socket bound to {bound[0]}:{bound[1]}, not {host}:{port}")
    return listener


def group_store(timeout_s: float) -> Any:
    """The store for this process's group as the environment describes it (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): torchrun's agent store under this attempt's prefix, the loopback
    store for a loopback rendezvous address, or None where torch should make its own."""
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "")
    port, world, rank = int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        timeout = datetime.timedelta(seconds=timeout_s)
        agent = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"tpcache/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    if not is_loopback_host(host):
        return None
    return loopback_store("127.0.0.1" if host == "localhost" else host, port, world, rank, timeout_s)
