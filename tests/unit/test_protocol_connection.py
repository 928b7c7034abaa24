"""Sans-IO connections: id assignment, reply matching, duplicates, overload, late replies."""

from __future__ import annotations

import pytest

import protocol as p
from protocol.messages import U64_MAX


def serve(server: p.ServerConnection, frame: bytes) -> bytes:
    """A tiny server: answers step with round = request id, match with no hit, others BAD_ARGUMENT."""
    try:
        request = server.receive(frame)
    except p.ProtocolError as exc:
        return server.reject(exc)
    if isinstance(request.body, p.StepRequest):
        return server.send(p.ok_response(request.id, p.StepResult(round=request.id)))
    if isinstance(request.body, p.MatchRequest):
        result = p.MatchResult(hit_tokens=0, device_pages=0, host_pages=0, storage_pages=0, device_page_ids=[])
        return server.send(p.ok_response(request.id, result))
    return server.send(p.error_response(request.id, p.InvalidArgument("not served here")))


def test_requests_and_replies_match_out_of_order() -> None:
    client, server = p.ClientConnection(), p.ServerConnection()
    sent = [client.send(p.StepRequest()) for _ in range(3)]
    ids = [rid for rid, _ in sent]
    assert ids == [1, 2, 3] and client.pending == {1, 2, 3}
    replies = [serve(server, frame) for _, frame in sent]
    assert server.pending == frozenset()
    for rid, reply in reversed(list(zip(ids, replies, strict=True))):
        response = client.receive(reply)
        assert response is not None and response.id == rid
        assert response.unwrap() == p.StepResult(round=rid)
    assert client.pending == frozenset()


def test_error_replies_raise_the_server_exception_type() -> None:
    client, server = p.ClientConnection(), p.ServerConnection()
    rid, frame = client.send(p.FlushRequest())
    response = client.receive(serve(server, frame))
    assert response is not None and not response.ok
    with pytest.raises(p.InvalidArgument, match="not served here") as info:
        response.unwrap()
    assert info.value.request_id == rid


def test_reply_to_an_unknown_id_or_with_the_wrong_op_is_refused() -> None:
    client = p.ClientConnection()
    stray = p.encode_response(p.ok_response(99, p.StepResult(round=1)))
    with pytest.raises(p.MalformedMessage, match="not in flight"):
        client.receive(stray)
    rid, _ = client.send(p.StepRequest())
    wrong = p.encode_response(p.ok_response(rid, p.FlushResult(round=1)))
    with pytest.raises(p.MalformedMessage, match="'step' but the reply is 'flush'"):
        client.receive(wrong)


def test_forgotten_request_drops_its_late_reply() -> None:
    client, server = p.ClientConnection(), p.ServerConnection()
    rid, frame = client.send(p.StepRequest())
    client.forget(rid)
    assert client.pending == frozenset()
    assert client.receive(serve(server, frame)) is None
    # Only once: a second copy of the same reply is a protocol violation.
    with pytest.raises(p.MalformedMessage):
        client.receive(p.encode_response(p.ok_response(rid, p.StepResult(round=rid))))


def test_reply_without_id_is_returned_unmatched() -> None:
    client, server = p.ClientConnection(), p.ServerConnection()
    client.send(p.StepRequest())
    response = client.receive(serve(server, b"\xc1garbage"))
    assert response is not None and response.id is None and response.error is not None
    assert response.error.code == p.ErrorCode.BAD_MESSAGE
    assert client.pending == {1}


def test_server_refuses_duplicate_ids_without_losing_the_original() -> None:
    server = p.ServerConnection()
    frame = p.encode_request(p.Request(5, p.StepRequest()))
    assert server.receive(frame).id == 5
    with pytest.raises(p.DuplicateRequest) as info:
        server.receive(frame)
    reply = p.decode_response(server.reject(info.value))
    assert reply.id == 5 and reply.error is not None and reply.error.name == "DUPLICATE_REQUEST"
    assert server.pending == {5}  # the original is still in flight
    server.send(p.ok_response(5, p.StepResult(round=0)))
    assert server.pending == frozenset()
    assert server.receive(frame).id == 5  # the id is free again


def test_server_sheds_load_past_max_pending() -> None:
    client, server = p.ClientConnection(), p.ServerConnection(max_pending=2)
    frames = [client.send(p.MatchRequest(tokens=[1]))[1] for _ in range(3)]
    server.receive(frames[0])
    server.receive(frames[1])
    with pytest.raises(p.Overloaded) as info:
        server.receive(frames[2])
    response = client.receive(server.reject(info.value))
    assert response is not None and response.id == 3
    with pytest.raises(p.Overloaded):
        response.unwrap()
    assert server.pending == {1, 2} and client.pending == {1, 2}


def test_client_ids_wrap_and_skip_ids_in_flight() -> None:
    client = p.ClientConnection(first_id=U64_MAX)
    assert client.send(p.StepRequest())[0] == U64_MAX
    assert client.send(p.StepRequest())[0] == 0
    client2 = p.ClientConnection(first_id=U64_MAX - 1)
    client2.send(p.StepRequest())  # U64_MAX - 1
    client2._next_id = U64_MAX - 1  # as if 2**64 more requests had gone by
    assert client2.send(p.StepRequest())[0] == U64_MAX


def test_client_does_not_register_a_request_it_could_not_encode() -> None:
    client = p.ClientConnection(limits=p.Limits(max_message_bytes=64))
    with pytest.raises(p.MessageTooLarge):
        client.send(p.MatchRequest(tokens=range(100)))
    assert client.pending == frozenset()


def test_admit_puts_an_id_in_flight_exactly_when_receive_would() -> None:
    server = p.ServerConnection(max_pending=2)
    assert server.admit(5)
    assert not server.admit(5)  # in flight: receive would say DUPLICATE_REQUEST
    with pytest.raises(p.DuplicateRequest):
        server.receive(p.encode_request(p.Request(5, p.MatchRequest(tokens=[1]))))
    assert server.admit(6)
    assert not server.admit(7)  # two in flight: receive would say OVERLOADED
    assert server.pending == {5, 6}
    server.send_ok(5, p.MatchResult.unchecked(0, 0, 0, 0, p.as_id_array([])))
    assert server.admit(7)


def test_finish_takes_a_request_out_of_flight_once() -> None:
    server = p.ServerConnection(max_pending=2)
    assert server.admit(3)
    assert server.finish(3) and not server.is_pending(3)
    assert not server.finish(3) and not server.finish(4)
    assert server.admit(3)  # its id may be used again
