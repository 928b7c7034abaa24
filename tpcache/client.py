"""The client library: typed calls to a tpcache service over ZMQ (DEALER to the leader's ROUTER).

``Client`` is synchronous and not thread-safe (one per thread). Every method returns the op's
typed result (``protocol.messages``) or raises the protocol's typed error (``NoSpace``,
``CacheClosed``, ``NotFound``, ...); no reply within ``timeout_s`` raises ``RequestTimeout`` and
the late reply, if it ever comes, is dropped. A connection's first call that times out says what
listens at the endpoint (nothing, or something that does not answer) and how to start a service.
Requests can be pipelined with ``submit`` and ``wait``. ``AsyncClient`` is the asyncio variant.
Needs only pyzmq, msgpack and ``protocol``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

import zmq
import zmq.asyncio

import protocol as p


def _open_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.DEFAULT_LIMITS.max_message_bytes + 1024)
    sock.connect(endpoint)
    return sock


START_HINT = "start one with `python -m launcher local --nproc 2 --endpoint {endpoint}`"


def endpoint_hint(endpoint: str, timeout_s: float = 1.0) -> str:
    """What listens at ``endpoint``, in words, and how to start a service there: the hint a
    first call that timed out carries (a TCP connect, or the ipc socket's path, is tried)."""
    start = START_HINT.format(endpoint=endpoint)
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if not os.path.exists(path):
            return f"nothing listens there (no socket at {path}): {start}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(path)
            except OSError as exc:
                why = (exc.strerror or str(exc)).lower()
                return f"nothing listens on the socket {path} ({why}; a stopped service leaves it behind): {start}"
        return f"something listens on {path} but sent no reply: a service still starting, or a busy one"
    parsed = urlparse(endpoint)
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if parsed.scheme != "tcp" or not host or not port:
        return f"endpoints look like tcp://HOST:PORT or ipc://PATH; {start}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except TimeoutError:
        return f"{host}:{port} did not accept a TCP connection within {timeout_s:g} s (a firewall, or no such host)"
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        return f"nothing listens on {host}:{port} ({why}): {start}"
    return (
        f"something listens on {host}:{port} but sent no reply: a service still starting, a busy or stopped one, "
        "or another program on that port"
    )


def _first_timeout(endpoint: str, exc: p.RequestTimeout) -> p.RequestTimeout:
    """``exc`` with the endpoint hint appended (the first call of a connection that timed out)."""
    return p.RequestTimeout(f"{exc.message}; {endpoint_hint(endpoint)}", request_id=exc.request_id)


class _Ops:
    """The typed op methods, shared by the sync and async clients through ``call``."""

    def call(self, body: p.Body, timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    def hello(self, token: str | None = None, client: str = "") -> Any:
        return self.call(p.HelloRequest(token=token, client=client))

    def match(self, tokens: Iterable[int], namespace: str = "", storage: bool | None = None) -> Any:
        """The cached prefix; ``storage=True`` also looks the rest up in storage (``storage_pages``)."""
        return self.call(p.MatchRequest(tokens=tokens, namespace=namespace, storage=storage))

    def lock(
        self, tokens: Iterable[int], namespace: str = "", prefetch: str | None = None, timeout_rounds: int | None = None
    ) -> Any:
        """Match and pin; ``prefetch`` (a stop policy, or "none") reads the storage continuation."""
        return self.call(
            p.LockRequest(tokens=tokens, namespace=namespace, prefetch=prefetch, timeout_rounds=timeout_rounds)
        )

    def prefetch(self, lease: int, policy: str = "wait_complete", timeout_rounds: int = 8) -> Any:
        return self.call(p.PrefetchRequest(lease=lease, policy=policy, timeout_rounds=timeout_rounds))

    def alloc(self, lease: int, num_pages: int) -> Any:
        return self.call(p.AllocRequest(lease=lease, num_pages=num_pages))

    def insert(self, tokens: Iterable[int], device_page_ids: Iterable[int], lease: int, namespace: str = "") -> Any:
        return self.call(
            p.InsertRequest(tokens=tokens, device_page_ids=device_page_ids, lease=lease, namespace=namespace)
        )

    def append(self, tokens: Iterable[int], device_page_ids: Iterable[int], lease: int, namespace: str = "") -> Any:
        """Cache a running request's new pages, alone: they follow what its last insert or append cached."""
        return self.call(
            p.AppendRequest(tokens=tokens, device_page_ids=device_page_ids, lease=lease, namespace=namespace)
        )

    def load(self, lease: int) -> Any:
        return self.call(p.LoadRequest(lease=lease))

    def release(self, lease: int) -> Any:
        return self.call(p.ReleaseRequest(lease=lease))

    def abort(self, lease: int) -> Any:
        return self.call(p.AbortRequest(lease=lease))

    def step(self) -> Any:
        return self.call(p.StepRequest())

    def flush(self) -> Any:
        return self.call(p.FlushRequest())

    def stats(self) -> Any:
        return self.call(p.StatsRequest())

    def health(self) -> Any:
        return self.call(p.HealthRequest())

    def set_config(self, **settings: Any) -> Any:
        return self.call(p.SetConfigRequest(**settings))

    def register_buffers(self, descriptors: Iterable[Mapping[str, Any]]) -> Any:
        return self.call(p.RegisterBuffersRequest(descriptors=tuple(descriptors)))

    def put_pages(self, page_ids: Iterable[int], data: bytes, lease: int | None = None) -> Any:
        return self.call(p.PutPagesRequest(page_ids=page_ids, data=data, lease=lease))

    def get_pages(self, page_ids: Iterable[int], lease: int | None = None) -> Any:
        return self.call(p.GetPagesRequest(page_ids=page_ids, lease=lease))


class Client(_Ops):
    """A synchronous connection to a tpcache service.

    ``token`` is the shared secret (servers started with one refuse every op until hello sends
    it). The constructor sends hello and keeps the result in ``info`` (page size, world size).
    ZMQ reconnects to a restarted server by itself; requests in flight then are lost (they time
    out), and a client with a token says hello again when the new server asks for it."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        timeout_s: float = 10.0,
        *,
        name: str = "",
        hello: bool = True,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sock = _open_socket(self._ctx, endpoint)
        self._conn = p.ClientConnection()
        self._done: dict[int, p.Response] = {}
        self._token, self._name = token, name
        self._answered = False  # a first call that times out says what listens at the endpoint
        self.info: p.HelloResult | None = None
        if hello:
            try:
                self.info = self.hello(token=token, client=name)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ pipelining

    def submit(self, body: p.Body) -> int:
        """Send a request without waiting; returns its id for ``wait``."""
        request_id, frame = self._conn.send(body)
        self._sock.send(frame, copy=len(frame) < 65536)
        return request_id

    def submit_many(self, bodies: Iterable[p.Body]) -> list[int]:
        """Encode every request, then send them back to back (a burst the service can batch into
        one round); returns their ids for ``wait``."""
        encoded = [self._conn.send(body) for body in bodies]
        for _, frame in encoded:
            self._sock.send(frame, copy=len(frame) < 65536)
        return [request_id for request_id, _ in encoded]

    def wait(self, request_id: int, timeout_s: float | None = None) -> Any:
        """The result of a submitted request (or its typed error)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while request_id not in self._done:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                if request_id in self._done:
                    break
                self._conn.forget(request_id)
                raise p.RequestTimeout(f"no reply from {self.endpoint} within {timeout:g} s", request_id=request_id)
            self._read_available()
        self._answered = True
        return self._done.pop(request_id).unwrap()

    def _read_available(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            response = self._conn.receive(frame)
            if response is None:
                continue  # a late reply to a request we gave up on
            if response.id is None:  # the server could not read one of our frames
                raise response.error.exception() if response.error else p.InternalError("bad reply")
            self._done[response.id] = response

    def call(self, body: p.Body, timeout_s: float | None = None) -> Any:
        try:
            result = self.wait(self.submit(body), timeout_s)
        except p.RequestTimeout as exc:
            if self._answered:
                raise
            raise _first_timeout(self.endpoint, exc) from None
        except p.Unauthorized:
            # A server restarted behind the endpoint (ZMQ reconnects by itself) knows this client as
            # a new connection, which must say hello again: once, then the refused request again.
            if self._token is None or isinstance(body, p.HelloRequest):
                raise
            self.info = self.hello(token=self._token, client=self._name)
            return self.wait(self.submit(body), timeout_s)
        self._answered = True
        return result

    # ------------------------------------------------------------------ served hits

    def hit_pages(self, lock: p.LockResult) -> list[int]:
        """The device pages that hold ``lock``'s hit, in order, every one readable on return: the
        device hit as it is; host hits and storage hits loaded back to the device (first waiting
        for the storage reads the lock left running). The hit served is ``len(pages) * page_size``
        tokens; a storage hit that could not be read is left out (``lock.storage_reason`` says why)."""
        if lock.storage_reason == "reading":
            self.prefetch(lock.lease, policy="wait_complete")
        if lock.host_pages or lock.storage_pages:
            return list(self.load(lock.lease).device_page_ids)
        return list(lock.device_page_ids)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Ops):
    """The asyncio variant: ``await client.match(tokens)``; many calls may be in flight at once.
    Create with ``await AsyncClient.connect(endpoint, token=...)``."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = _open_socket(self._ctx, endpoint)
        self._conn = p.ClientConnection()
        self._futures: dict[int, asyncio.Future[p.Response]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._answered = False
        self.info: p.HelloResult | None = None

    @classmethod
    async def connect(
        cls, endpoint: str, token: str | None = None, timeout_s: float = 10.0, name: str = ""
    ) -> AsyncClient:
        client = cls(endpoint, timeout_s)
        try:
            client.info = await client.hello(token=token, client=name)
        except BaseException:
            client.close()
            raise
        return client

    async def _read_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                response = self._conn.receive(frame)
            except p.ProtocolError:
                continue
            if response is None or response.id is None:
                continue
            future = self._futures.pop(response.id, None)
            if future is not None and not future.done():
                future.set_result(response)

    async def call(self, body: p.Body, timeout_s: float | None = None) -> Any:  # type: ignore[override]
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        request_id, frame = self._conn.send(body)
        future: asyncio.Future[p.Response] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        await self._sock.send(frame)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            response = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._futures.pop(request_id, None)
            self._conn.forget(request_id)
            late = p.RequestTimeout(f"no reply from {self.endpoint} within {timeout:g} s", request_id=request_id)
            if not self._answered:
                late = await asyncio.get_running_loop().run_in_executor(None, _first_timeout, self.endpoint, late)
            raise late from None
        self._answered = True
        return response.unwrap()

    async def hit_pages(self, lock: p.LockResult) -> list[int]:
        """``Client.hit_pages``: the device pages that hold ``lock``'s hit, each readable on return."""
        if lock.storage_reason == "reading":
            await self.prefetch(lock.lease, policy="wait_complete")
        if lock.host_pages or lock.storage_pages:
            return list((await self.load(lock.lease)).device_page_ids)
        return list(lock.device_page_ids)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
