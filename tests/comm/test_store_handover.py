"""The rendezvous socket ``launcher local`` binds and hands to rank 0: no other process can take the
port between its choice and the store's start (``tpcache.comm.store.LISTEN_FD_ENV``)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tpcache.comm.store import LISTEN_FD_ENV, loopback_store


def listening() -> tuple[socket.socket, int]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener, int(listener.getsockname()[1])


def test_rank_0_serves_on_the_socket_it_was_handed(monkeypatch):
    listener, port = listening()
    monkeypatch.setenv(LISTEN_FD_ENV, str(listener.detach()))
    store = loopback_store("127.0.0.1", port, 1, 0, 10.0)  # a group of one: the server waits for nobody
    peer = loopback_store("127.0.0.1", port, 1, 1, 10.0)  # a client finds it on that port
    peer.set("k", "v")
    assert store.get("k") == b"v"
    assert LISTEN_FD_ENV not in os.environ  # claimed once: nothing the rank starts inherits it


def test_a_socket_for_another_address_is_refused(monkeypatch):
    listener, port = listening()
    monkeypatch.setenv(LISTEN_FD_ENV, str(listener.detach()))
    with pytest.raises(RuntimeError, match=f"bound to 127.0.0.1:{port}, not 127.0.0.1:{port + 1}"):
        loopback_store("127.0.0.1", port + 1, 2, 0, 10.0)


def test_the_launcher_hands_rank_0_its_bound_socket(monkeypatch):
    """``spawn_ranks`` binds the port before the ranks start: a process that takes the port first
    cannot exist, so binding it again from outside fails while the group runs."""
    from launcher import local

    seen: list[dict] = []

    class Recorder:
        def __init__(self, argv, env, pass_fds=(), **kw):  # noqa: ANN001
            seen.append({"env": env, "fds": pass_fds})
            if pass_fds:  # what rank 0 would find: a socket bound to MASTER_PORT and listening
                probe = socket.socket(fileno=socket.dup(pass_fds[0]))
                seen[-1]["bound"] = probe.getsockname()
                probe.close()

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    local.spawn_ranks(local.ServiceConfig(), 2)
    rank0, rank1 = seen
    port = int(rank0["env"]["MASTER_PORT"])
    assert rank0["bound"] == ("127.0.0.1", port) and rank0["env"][LISTEN_FD_ENV] == str(rank0["fds"][0])
    assert rank1["fds"] == () and LISTEN_FD_ENV not in rank1["env"]
