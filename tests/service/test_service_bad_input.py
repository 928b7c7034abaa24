"""Hostile input at the front door: each gets a typed error (or is dropped), never a crash, and
every rank keeps serving correct answers afterwards (checked after each case)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import Service, pid_alive

# One worker runs the whole module, so its shared service starts once (under --dist loadgroup the
# module's tests would otherwise be spread over both workers, each starting its own).
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("service_bad_input")]


@pytest.fixture
def raw(service: Service) -> Iterator[zmq.Socket]:
    """A bare DEALER: frames go to the server exactly as written. Afterwards the service must be
    healthy: both ranks alive, correct hits, equal digests."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        yield sock
    finally:
        sock.close()
    assert all(pid_alive(pid) for pid in service.pids), service.log()
    cache_round_trip(service)


def reply(sock: zmq.Socket, timeout_s: float = 20.0) -> p.Response:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return p.decode_response(sock.recv())


def send_obj(sock: zmq.Socket, obj: object) -> p.Response:
    sock.send(msgpack.packb(obj, use_bin_type=True))
    return reply(sock)


def error_of(response: p.Response) -> p.ErrorCode:
    assert response.error is not None, response
    return p.ErrorCode(response.error.code)


def test_garbage_frames_get_bad_message(raw: zmq.Socket) -> None:
    rng = random.Random(7)
    frames = [b"\xc1", b"\x00", b"not msgpack at all", bytes(rng.getrandbits(8) for _ in range(300))]
    frames += [os.urandom(rng.randrange(1, 64)) for _ in range(30)]
    for frame in frames:
        raw.send(frame)
        r = reply(raw)
        assert not r.ok and error_of(r) in (p.ErrorCode.BAD_MESSAGE, p.ErrorCode.TOO_LARGE), (frame, r)


def test_empty_frame_and_extra_envelope_frames(raw: zmq.Socket) -> None:
    raw.send(b"")
    assert error_of(reply(raw)) == p.ErrorCode.BAD_MESSAGE
    # Envelope frames past the limit are refused, not echoed: the error comes without them.
    raw.send_multipart([b"a", b"b", b"c", b"d", p.encode_request(p.Request(4, p.HealthRequest()))])
    assert error_of(reply(raw)) == p.ErrorCode.TOO_LARGE
    raw.send_multipart([bytes(1024), p.encode_request(p.Request(4, p.HealthRequest()))])
    assert error_of(reply(raw)) == p.ErrorCode.TOO_LARGE
    raw.send(p.encode_request(p.Request(5, p.HealthRequest())))
    r = reply(raw)
    assert r.ok and r.id == 5


def test_truncated_msgpack(raw: zmq.Socket) -> None:
    frame = p.encode_request(p.Request(11, p.MatchRequest(tokens=list(range(64)))))
    for cut in (1, 5, len(frame) // 2, len(frame) - 1):
        raw.send(frame[:cut])
        assert error_of(reply(raw)) == p.ErrorCode.BAD_MESSAGE


def test_oversized_inputs(raw: zmq.Socket, service: Service) -> None:
    # An array longer than the limit, a bin over the inline limit: refused before building them.
    r = send_obj(raw, {"v": 1, "id": 1, "op": "match", "args": {"tokens": list(range(5000))}})
    assert error_of(r) == p.ErrorCode.TOO_LARGE
    big = {"page_ids": p.pack_ids([0]), "data": bytes(p.DEFAULT_LIMITS.max_inline_bytes + 8)}
    r = send_obj(raw, {"v": 1, "id": 2, "op": "put_pages", "args": big})
    assert error_of(r) == p.ErrorCode.TOO_LARGE and r.id == 2
    deep: object = 0
    for _ in range(40):
        deep = [deep]
    assert error_of(send_obj(raw, deep)) == p.ErrorCode.TOO_LARGE
    # A frame over the message limit: the transport drops the connection, the server is unharmed.
    ctx = zmq.Context.instance()
    huge = ctx.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    huge.connect(service.endpoint)
    huge.send(bytes(p.DEFAULT_LIMITS.max_message_bytes + 2048))
    assert not huge.poll(500)
    huge.close()


def test_wrong_types_unknown_ops_and_versions(raw: zmq.Socket) -> None:
    cases = [
        ({"v": 1, "id": 3, "op": "match", "args": {"tokens": ["a", "b"]}}, p.ErrorCode.BAD_ARGUMENT),
        ({"v": 1, "id": 4, "op": "match", "args": {"tokens": b"\x01\x02\x03"}}, p.ErrorCode.BAD_ARGUMENT),
        ({"v": 1, "id": 5, "op": "alloc", "args": {"lease": True, "num_pages": 1}}, p.ErrorCode.BAD_ARGUMENT),
        ({"v": 1, "id": 6, "op": "alloc", "args": {"lease": 1, "num_pages": -1}}, p.ErrorCode.BAD_ARGUMENT),
        ({"v": 1, "id": 7, "op": "match", "args": {"tokens": b"", "evil": 1}}, p.ErrorCode.BAD_ARGUMENT),
        ({"v": 1, "id": 8, "op": "launch_missiles", "args": {}}, p.ErrorCode.UNKNOWN_OP),
        ({"v": 2, "id": 9, "op": "health", "args": {}}, p.ErrorCode.UNSUPPORTED_VERSION),
        ({"v": 1, "id": "ten", "op": "health", "args": {}}, p.ErrorCode.BAD_MESSAGE),
        ({"v": 1, "id": 12, "op": "health"}, p.ErrorCode.BAD_MESSAGE),
        ([1, 2, 3], p.ErrorCode.BAD_MESSAGE),
        ({"v": 1, "id": 13, "op": 5, "args": {}}, p.ErrorCode.BAD_MESSAGE),
    ]
    for obj, code in cases:
        r = send_obj(raw, obj)
        assert error_of(r) == code, (obj, r)
        if isinstance(obj, dict) and type(obj.get("id")) is int:
            assert r.id == obj["id"]


def test_duplicate_request_ids_in_flight(raw: zmq.Socket) -> None:
    frame = p.encode_request(p.Request(77, p.MatchRequest(tokens=fresh_tokens(64))))
    raw.send(frame)
    raw.send(frame)
    replies = [reply(raw), reply(raw)]
    assert all(r.id == 77 for r in replies)
    errors = [error_of(r) for r in replies if not r.ok]
    # Both in one batch: the second is refused while the first waits for its round. (If the first
    # was answered before the second arrived, both are fine.)
    assert errors in ([], [p.ErrorCode.DUPLICATE_REQUEST]), replies


def test_flood_of_requests(raw: zmq.Socket) -> None:
    n = 5000
    tokens = p.pack_ids(fresh_tokens(256))
    for i in range(n):
        raw.send(msgpack.packb({"v": 1, "id": i, "op": "match", "args": {"tokens": tokens}}))
    seen = set()
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        r = reply(raw)
        assert r.ok or error_of(r) == p.ErrorCode.OVERLOADED
        seen.add(r.id)
    assert seen == set(range(n))


def test_client_disconnects_mid_request(service: Service) -> None:
    ctx = zmq.Context.instance()
    for i in range(20):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(service.endpoint)
        op = p.LockRequest(tokens=fresh_tokens(16)) if i % 2 else p.StatsRequest()
        sock.send(p.encode_request(p.Request(1, op)))
        sock.close()  # gone before the reply
    assert all(pid_alive(pid) for pid in service.pids)
    cache_round_trip(service)
