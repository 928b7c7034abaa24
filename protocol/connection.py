"""Sans-IO connection state: request ids in flight, reply matching, duplicate detection.

No sockets here: the caller moves frames; these objects only say what a frame means and whether
it fits the conversation so far. A ROUTER server keeps one ServerConnection per peer identity.
Neither is thread-safe: use one per socket, from one thread.
"""

from __future__ import annotations

from collections import OrderedDict

from protocol.codec import (
    decode_request,
    decode_response,
    encode_ok,
    encode_request,
    encode_response,
    error_response,
)
from protocol.errors import DuplicateRequest, MalformedMessage, Overloaded, ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import U64_MAX, Body, Request, Response

MAX_ABANDONED = 4096  # forgotten request ids remembered so their late replies are dropped quietly


class ClientConnection:
    """Numbers requests, remembers which are in flight and matches replies to them.

    Invariant: every id in ``pending`` was sent and has had no reply; ids are never reused while
    pending (they count up from ``first_id`` and wrap at 2**64).
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, first_id: int = 1) -> None:
        self.limits = limits
        self._next_id = first_id
        self._pending: dict[int, str] = {}  # request id -> op
        self._abandoned: OrderedDict[int, None] = OrderedDict()

    @property
    def pending(self) -> frozenset[int]:
        return frozenset(self._pending)

    def send(self, body: Body) -> tuple[int, bytes]:
        """A new request id and the frame to send. Raises MessageTooLarge if it does not fit."""
        while self._next_id in self._pending or self._next_id in self._abandoned:
            self._next_id = (self._next_id + 1) & U64_MAX
        request_id = self._next_id
        frame = encode_request(Request(request_id, body), self.limits)
        self._next_id = (request_id + 1) & U64_MAX
        self._pending[request_id] = body.OP
        return request_id, frame

    def receive(self, frame: bytes) -> Response | None:
        """The reply in ``frame``; None for a late reply to a forgotten request. A reply with id
        None (the server could not read the request) is returned and matches nothing. Raises
        MalformedMessage for a reply to an id that was never sent or with another op's result."""
        response = decode_response(frame, self.limits)
        if response.id is None:
            return response
        op = self._pending.pop(response.id, None)
        if op is None:
            if response.id in self._abandoned:
                del self._abandoned[response.id]
                return None
            raise MalformedMessage(f"a reply to request {response.id}, which is not in flight")
        if response.result is not None and op != response.result.OP:
            raise MalformedMessage(f"request {response.id} was {op!r} but the reply is {response.result.OP!r}")
        return response

    def forget(self, request_id: int) -> None:
        """Stop waiting for ``request_id`` (a client-side timeout); its late reply is dropped."""
        if self._pending.pop(request_id, None) is not None:
            self._abandoned[request_id] = None
            if len(self._abandoned) > MAX_ABANDONED:
                self._abandoned.popitem(last=False)


class ServerConnection:
    """One client's requests in flight on the server side.

    Invariant: an id is in ``pending`` from the accepted request until ``send`` of its reply; a
    second request with that id meanwhile is refused (DuplicateRequest), as is any request past
    ``max_pending`` (Overloaded).
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, max_pending: int = 1024) -> None:
        self.limits = limits
        self.max_pending = max_pending
        self._pending: set[int] = set()

    @property
    def pending(self) -> frozenset[int]:
        return frozenset(self._pending)

    @property
    def num_pending(self) -> int:
        """How many requests are in flight (no copy of the set: checked once per request)."""
        return len(self._pending)

    def is_pending(self, request_id: int | None) -> bool:
        return request_id in self._pending

    def receive(self, frame: bytes) -> Request:
        """The request in ``frame``, now in flight. Raises ProtocolError (with ``request_id`` set
        when readable); answer it with ``reject``."""
        request = decode_request(frame, self.limits)
        if request.id in self._pending:
            raise DuplicateRequest(f"request id {request.id} is already in flight", request_id=request.id)
        if len(self._pending) >= self.max_pending:
            raise Overloaded(f"{len(self._pending)} requests already in flight", request_id=request.id)
        self._pending.add(request.id)
        return request

    def admit(self, request_id: int) -> bool:
        """Put ``request_id`` in flight when ``receive`` would accept a request with it (not in
        flight, fewer than ``max_pending`` in flight); False, and nothing changes, otherwise (then
        ``receive`` of the frame says why). For a server that read the request another way."""
        pending = self._pending
        if request_id in pending or len(pending) >= self.max_pending:
            return False
        pending.add(request_id)
        return True

    def send(self, response: Response) -> bytes:
        """The frame of the reply to an accepted request; the request is no longer in flight."""
        if response.id is not None:
            self._pending.discard(response.id)
        return encode_response(response, self.limits)

    def finish(self, request_id: int) -> bool:
        """Take ``request_id`` out of flight for a reply the server encodes itself (as ``send``
        would); False, and nothing changes, when it is not in flight."""
        pending = self._pending
        if request_id not in pending:
            return False
        pending.remove(request_id)
        return True

    def send_ok(self, request_id: int, result: Body) -> bytes:
        """``send`` of a successful reply, without building a Response (the server's hot path)."""
        self._pending.discard(request_id)
        return encode_ok(request_id, result, self.limits)

    def reject(self, exc: ProtocolError) -> bytes:
        """The error reply to a frame ``receive`` refused; what is in flight does not change."""
        return encode_response(error_response(exc.request_id, exc), self.limits)
