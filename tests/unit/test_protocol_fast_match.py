"""The C reader of plain match requests and writer of match replies (protocol/_match.c) against
the reference codec: whatever frame comes in, ``decode_request`` (C first) and
``decode_request_py`` give the same request or the same error; ``encode_ok`` and ``encode_ok_py``
give the same bytes."""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
import protocol.codec as codec

pytestmark = pytest.mark.skipif(codec._c_match_request is None, reason="the C helpers were not built")


def outcome(decode: Any, frame: bytes, limits: p.Limits = p.DEFAULT_LIMITS) -> Any:
    """What decoding ``frame`` gives: the request, or the error's type, message and request id."""
    try:
        return decode(frame, limits)
    except p.ProtocolError as exc:
        return (type(exc), exc.message, exc.request_id)


def same(frame: bytes, limits: p.Limits = p.DEFAULT_LIMITS) -> Any:
    fast = outcome(p.decode_request, frame, limits)
    assert fast == outcome(codec.decode_request_py, frame, limits), frame[:80]
    same_tokens(frame, limits)
    return fast


def same_tokens(frame: bytes, limits: p.Limits = p.DEFAULT_LIMITS) -> None:
    """``match_tokens`` reads a frame (from any buffer) exactly when ``decode_match`` does, as the
    same request with the tokens as their wire bytes."""
    found = p.match_tokens(frame, limits)
    request = codec.decode_match(frame, limits)
    if request is None:
        assert found is None, frame[:80]
        return
    body = request.body
    assert isinstance(body, p.MatchRequest)
    assert found == (request.id, body.tokens.tobytes(), body.storage)
    assert type(found[1]) is bytes
    assert p.match_tokens(memoryview(frame), limits) == found


def raw_map(*pairs: tuple[bytes, bytes]) -> bytes:
    """A msgpack map written pair by pair (keys and values already packed): any order, repeats."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


def pk(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def match_frame(
    rid: Any = 7, tokens: Any = None, order: tuple[str, ...] = ("v", "id", "op", "args"), **args: Any
) -> bytes:
    tokens = p.pack_ids(range(40)) if tokens is None else tokens
    body = {"tokens": tokens, **args}
    values = {"v": 1, "id": rid, "op": "match", "args": body}
    return raw_map(*((pk(k), pk(values[k])) for k in order))


def test_a_plain_match_is_read_in_c_and_equals_the_reference() -> None:
    for frame in (
        p.encode_request(p.Request(7, p.MatchRequest(tokens=range(4096)))),  # what the client sends
        match_frame(),  # no namespace
        match_frame(order=("args", "op", "id", "v")),
        match_frame(storage=None),
        match_frame(storage=False),
        match_frame(storage=True, namespace=""),
        match_frame(tokens=b""),
        match_frame(tokens=p.pack_ids([0, 2**31 - 1] * 100)),  # bin16
        match_frame(tokens=p.pack_ids(range(20_000))),  # bin32
    ):
        fast = codec.decode_match(frame)
        assert fast is not None, frame[:40]
        assert fast == codec.decode_request_py(frame)
        assert type(fast.body.tokens) is array and fast.body.tokens.typecode == "i"
        same_tokens(frame)
        assert p.match_tokens(frame) is not None
    for rid in (0, 127, 128, 255, 256, 2**16, 2**32 - 1, 2**32, 2**64 - 1):
        assert same(match_frame(rid)).id == rid


@pytest.mark.parametrize(
    "frame",
    [
        match_frame(namespace="other"),  # the general path decides namespaces
        match_frame(storage=1),
        match_frame(tokens=p.pack_ids([1, 2])[:-1]),  # not whole ids
        match_frame(tokens=p.pack_ids([1, 2]) + b"\x00\x00\x00\x80"),  # negative id
        match_frame(tokens=[1, 2]),  # a list, not a bin
        match_frame(rid=-1),
        match_frame(rid=None),
        match_frame(extra=1),
        match_frame() + b"\x00",  # trailing bytes
        match_frame()[:-1],  # truncated
        pk({"v": 2, "id": 1, "op": "match", "args": {"tokens": b""}}),
        pk({"v": 1, "id": 1, "op": "lock", "args": {"tokens": b""}}),
        pk({"v": 1, "id": 1, "op": "match", "args": {}}),
        pk({"v": 1, "id": 1, "op": "match"}),
        pk({"v": 1, "id": 1, "op": "match", "args": {"tokens": b""}, "x": 0}),
        raw_map((pk("v"), pk(1)), (pk("id"), pk(1)), (pk("op"), pk("match")), (pk("id"), pk(2))),  # repeated key
        raw_map(
            (pk("v"), pk(1)),
            (pk("id"), pk(1)),
            (pk("op"), pk("match")),
            (pk("args"), raw_map((pk("tokens"), pk(b"")), (pk("tokens"), pk(b"\x01\x00\x00\x00")))),
        ),
    ],
)
def test_anything_else_is_left_to_the_general_decoder(frame: bytes) -> None:
    assert codec.decode_match(frame) is None
    assert p.match_tokens(frame) is None
    same(frame)


def test_match_tokens_reads_a_transport_frame_without_copying_it_first() -> None:
    zmq = pytest.importorskip("zmq")
    frame = p.encode_request(p.Request(9, p.MatchRequest(tokens=range(4096), storage=False)))
    found = p.match_tokens(zmq.Frame(frame))
    assert found == (9, p.pack_ids(range(4096)), False)


def test_limits_are_those_of_the_reference() -> None:
    frame = match_frame(tokens=p.pack_ids(range(100)))
    for limits in (
        p.Limits(max_ids=99),
        p.Limits(max_bin_len=399),
        p.Limits(max_message_bytes=len(frame) - 1),
        p.Limits(max_depth=1),
    ):
        assert codec.decode_match(frame, limits) is None, limits
        assert isinstance(same(frame, limits), tuple), limits  # refused, the same way
    # Bounds too tight for every frame the C reader reads: left to the reference, which reads this one.
    assert codec.decode_match(frame, p.Limits(max_str_len=8)) is None
    assert same(frame, p.Limits(max_str_len=8)) == codec.decode_request_py(frame)
    loose = p.Limits(max_ids=100, max_bin_len=400, max_message_bytes=len(frame))
    assert codec.decode_match(frame, loose) is not None
    same(frame, loose)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**31 - 1), max_size=80),
    st.sampled_from([{}, {"namespace": ""}, {"storage": None}, {"storage": True}, {"namespace": "", "storage": False}]),
    st.permutations(["v", "id", "op", "args"]),
    st.integers(0, 2**16),
    st.integers(0, 255),
)
def test_every_mutation_of_a_match_frame_decodes_like_the_reference(
    rid: int, ids: list[int], args: dict[str, Any], order: list[str], where: int, byte: int
) -> None:
    frame = match_frame(rid, p.pack_ids(ids), tuple(order), **args)
    assert codec.decode_match(frame) == codec.decode_request_py(frame)
    cut = where % (len(frame) + 1)
    same(frame[:cut])
    if cut < len(frame):
        same(frame[:cut] + bytes([byte]) + frame[cut + 1 :])
        same(frame[:cut] + bytes([byte]) + frame[cut:])


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**63 - 1), min_size=4, max_size=4),
    st.sampled_from([0, 1, 63, 64, 65, 16383, 16384, 16385]),
)
def test_the_c_match_reply_is_the_reference_bytes(rid: int, counts: list[int], n: int) -> None:
    result = p.MatchResult.unchecked(*counts, array("i", range(n)))
    frame = p.encode_ok(rid, result)
    assert frame == codec.encode_ok_py(rid, result)
    assert p.decode_response(frame).unwrap() == result
    listed = p.MatchResult.unchecked(*counts, list(range(n)))  # not an array: packed the reference way
    assert p.encode_ok(rid, listed) == frame


def test_a_match_reply_over_the_frame_limit_is_refused_like_the_reference() -> None:
    result = p.MatchResult.unchecked(0, 0, 0, 0, array("i", range(1000)))
    limits = p.Limits(max_message_bytes=1000)
    with pytest.raises(p.MessageTooLarge) as fast:
        p.encode_ok(1, result, limits)
    with pytest.raises(p.MessageTooLarge) as reference:
        codec.encode_ok_py(1, result, limits)
    assert fast.value.message == reference.value.message


@pytest.mark.parametrize("count", [1, 2, 3, 5, 4095, 4096])
def test_a_negative_id_anywhere_in_a_long_bin_is_left_to_the_general_decoder(count: int) -> None:
    """The C reader checks the ids' signs as it copies them out (``match_tokens``), in words and
    then a last id: a negative id at either end or in between declines the frame, as does the
    reference; all non-negative ids come out as their bytes."""
    ids = list(range(count))
    for at in sorted({0, count // 2, count - 1}):
        bad = ids.copy()
        bad[at] = -1 - at
        frame = match_frame(tokens=array("i", bad).tobytes())
        assert p.match_tokens(frame) is None and codec.decode_match(frame) is None
        same(frame)
    frame = match_frame(tokens=array("i", ids).tobytes())
    assert p.match_tokens(frame) == (7, p.pack_ids(ids), None)
    same(frame)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**63 - 1), min_size=4, max_size=4),
    st.sampled_from([0, 1, 255, 256, 16383, 16384]),
)
def test_encode_match_ok_is_encode_ok_of_the_same_fields(rid: int, counts: list[int], n: int) -> None:
    """A server's lookup replies are written from the match's fields (``encode_match_ok``): the
    frame ``encode_ok`` and the reference give for that body, for an array or any ids."""
    ids = array("i", range(n))
    frame = p.encode_match_ok(rid, *counts, ids)
    assert frame == codec.encode_ok_py(rid, p.MatchResult.unchecked(*counts, ids))
    assert p.encode_match_ok(rid, *counts, list(range(n))) == frame


def test_encode_match_ok_refuses_a_reply_over_the_frame_limit_like_the_reference() -> None:
    limits = p.Limits(max_message_bytes=1000)
    with pytest.raises(p.MessageTooLarge) as fast:
        p.encode_match_ok(1, 0, 0, 0, 0, array("i", range(1000)), limits)
    with pytest.raises(p.MessageTooLarge) as reference:
        codec.encode_ok_py(1, p.MatchResult.unchecked(0, 0, 0, 0, array("i", range(1000))), limits)
    assert fast.value.message == reference.value.message
