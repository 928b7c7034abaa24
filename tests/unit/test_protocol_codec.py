"""Codec against bad input: each case must raise the matching ProtocolError, with the id if readable."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
import protocol.codec as codec_module
import protocol.ids as ids_module
from protocol.codec import scan
from protocol.ids import pack_ids


def frame(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def request_obj(op: str = "match", args: Any = None, **envelope: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "v": 1,
        "id": 77,
        "op": op,
        "args": {"tokens": pack_ids([1, 2])} if args is None else args,
    }
    obj.update(envelope)
    return obj


def raises(exc_type: type[p.ProtocolError], data: Any, limits: p.Limits = p.DEFAULT_LIMITS) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(data, limits)
    assert type(info.value) is exc_type, repr(info.value)
    return info.value


def test_valid_request_decodes_from_any_buffer_type() -> None:
    data = frame(request_obj())
    for buf in (data, bytearray(data), memoryview(data)):
        assert p.decode_request(buf).body == p.MatchRequest(tokens=[1, 2])


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x84", b"\x81\xa1v", b"\xd4\x01\x00", b"\xc7\x00\x05", "a str", 12, None],
)
def test_garbage_is_a_malformed_message(data: Any) -> None:
    err = raises(p.MalformedMessage, data)
    assert err.request_id is None


def test_every_truncation_of_a_valid_frame_is_malformed() -> None:
    data = frame(request_obj())
    for cut in range(len(data)):
        raises(p.MalformedMessage, data[:cut])


def test_trailing_bytes_are_malformed() -> None:
    raises(p.MalformedMessage, frame(request_obj()) + b"\x00")


@pytest.mark.parametrize(
    "obj",
    [
        [1, 77, "match", {}],  # not a map
        {"id": 77, "op": "match", "args": {}},  # no version
        {"v": "1", "id": 77, "op": "match", "args": {}},
        request_obj(extra=1),
        request_obj(op=5),
        {"v": 1, "id": 77, "op": "step"},  # no args
        {"v": 1, "id": 77, "op": "step", "args": {}, b"bin key": 1},
    ],
)
def test_bad_envelopes_are_malformed(obj: Any) -> None:
    err = raises(p.MalformedMessage, frame(obj))
    if isinstance(obj, dict) and "v" in obj and obj["v"] == 1 and b"bin key" not in obj:
        assert err.request_id == 77  # the id was readable, so the reply can be matched


@pytest.mark.parametrize("bad_id", [-1, -(2**63), 1.5, "7", None, True, [7]])
def test_bad_request_ids(bad_id: Any) -> None:
    err = raises(p.MalformedMessage, frame({"v": 1, "id": bad_id, "op": "step", "args": {}}))
    assert err.request_id is None


def test_largest_request_id_is_accepted() -> None:
    assert p.decode_request(frame(request_obj(id=2**64 - 1))).id == 2**64 - 1


@pytest.mark.parametrize("version", [0, 2, 2**40, -1])
def test_wrong_version(version: int) -> None:
    err = raises(p.UnsupportedVersion, frame(request_obj(v=version)))
    assert err.request_id == 77


def test_unknown_op() -> None:
    err = raises(p.UnknownOp, frame(request_obj(op="drop_all_tables", args={})))
    assert err.request_id == 77 and "drop_all_tables" in err.message
    long = raises(p.UnknownOp, frame(request_obj(op="x" * 4000, args={})))
    assert len(long.message) < 600  # the op name is echoed only in part


@pytest.mark.parametrize(
    ("op", "args", "needle"),
    [
        ("match", [], "map"),
        ("match", {}, "missing required argument 'tokens'"),
        ("match", {"tokens": [1, 2]}, "expected bin"),
        ("match", {"tokens": b"\x01\x00\x00"}, "whole number"),
        ("match", {"tokens": b"\x01\x00\x00\x80"}, "non-negative"),
        ("match", {"tokens": b"", "namespace": 1}, "expected str"),
        ("match", {"tokens": b"", "bogus": 1}, "unknown argument"),
        ("release", {"lease": -3}, "outside"),
        ("release", {"lease": True}, "expected int"),
        ("release", {"lease": None}, "expected int"),
        ("alloc", {"lease": 1, "num_pages": 0}, "outside"),
        ("alloc", {"lease": 1, "num_pages": 2**31}, "outside"),
        ("insert", {"tokens": b"", "device_page_ids": b"", "lease": "x"}, "expected int"),
        ("set_config", {}, "no setting"),
        ("set_config", {"retention_cap_tokens": 1.5}, "expected int"),
        ("set_config", {"no_such_setting": 1}, "unknown argument"),
        ("register_buffers", {"descriptors": {}}, "expected list"),
        ("register_buffers", {"descriptors": [[1]]}, "expected map"),
        ("register_buffers", {"descriptors": [{"rank": [1]}]}, "not an allowed value type"),
        ("put_pages", {"page_ids": pack_ids([1, 2]), "data": b"xyz"}, "split evenly"),
        ("put_pages", {"page_ids": b"", "data": "text"}, "expected bin"),
        ("hello", {"token": 5}, "expected str"),
    ],
)
def test_bad_arguments(op: str, args: Any, needle: str) -> None:
    err = raises(p.InvalidArgument, frame(request_obj(op=op, args=args)))
    assert err.request_id == 77
    assert needle in err.message and err.message.startswith(op)


def test_oversized_frame_is_refused_before_decoding() -> None:
    small = p.Limits(max_message_bytes=64)
    data = frame(request_obj(args={"tokens": pack_ids(range(32))}))
    raises(p.MessageTooLarge, data, small)
    raises(p.MessageTooLarge, b"\xc1" * 65, small)  # even garbage: the size check comes first


@pytest.mark.parametrize(
    ("limits", "obj"),
    [
        (p.Limits(max_str_len=8), request_obj(op="hello", args={"client": "x" * 9})),
        (p.Limits(max_bin_len=8), request_obj(args={"tokens": pack_ids([1, 2, 3])})),
        (p.Limits(max_array_len=2), request_obj(op="register_buffers", args={"descriptors": [{}, {}, {}]})),
        (p.Limits(max_map_len=3), request_obj(op="hello", args={"a": 1, "b": 2, "c": 3, "d": 4})),
        (p.Limits(max_objects=10), request_obj(op="register_buffers", args={"descriptors": [{}] * 8})),
        (p.Limits(max_ids=2), request_obj(args={"tokens": pack_ids([1, 2, 3])})),
        (p.Limits(max_inline_bytes=4), request_obj(op="put_pages", args={"page_ids": b"", "data": b"x" * 5})),
    ],
)
def test_each_limit(limits: p.Limits, obj: Any) -> None:
    raises(p.MessageTooLarge, frame(obj), limits)
    # The same frame is fine (or at worst a different error) under the default limits.
    try:
        p.decode_request(frame(obj))
    except p.ProtocolError as exc:
        assert type(exc) is not p.MessageTooLarge


def test_deep_nesting() -> None:
    nested: Any = 1
    for _ in range(8):
        nested = [nested]
    raises(p.MessageTooLarge, frame(request_obj(op="hello", args={"client": nested})))
    # Nesting past msgpack's own stack limit is still a ProtocolError, found by the scan.
    raises(p.MessageTooLarge, b"\x91" * 5000 + b"\x01")
    # Depth 8 exactly (envelope, args, then 6 arrays) passes the scan and fails the schema.
    ok_depth: Any = 1
    for _ in range(6):
        ok_depth = [ok_depth]
    raises(p.InvalidArgument, frame(request_obj(op="hello", args={"client": ok_depth})))


def test_invalid_utf8_and_non_str_map_keys() -> None:
    bad_utf8 = b"\x84\xa1v\x01\xa2id\x05\xa2op\xa2\xff\xfe\xa4args\x80"
    raises(p.MalformedMessage, bad_utf8)
    err = raises(p.MalformedMessage, b"\x81\x01\x02")  # an int map key
    assert "keys must be strings" in err.message
    err = raises(p.MalformedMessage, frame({"v": 1, "id": 5, "op": "step", "args": {b"k": 1}}))
    assert "keys must be strings" in err.message


def raw_map(*pairs: tuple[bytes, Any]) -> bytes:
    """A msgpack map written pair by pair (a dict cannot hold the same key twice)."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(key + frame(value) for key, value in pairs)


def test_duplicate_map_keys_are_refused_at_every_level() -> None:
    # Last key wins in msgpack: without the check this health request would run flush.
    envelope = [(frame("v"), 1), (frame("id"), 9), (frame("op"), "health"), (frame("args"), {})]
    err = raises(p.MalformedMessage, raw_map(*envelope, (frame("op"), "flush")))
    assert "duplicate map key" in err.message
    args = raw_map((frame("tokens"), pack_ids([1])), (frame("tokens"), pack_ids([2])))
    head = raw_map((frame("v"), 1), (frame("id"), 3), (frame("op"), "match"))
    nested = bytes([0x84]) + head[1:] + frame("args") + args
    assert "duplicate map key" in raises(p.MalformedMessage, nested).message
    # The same key in two encodings (fixstr and str8) is the same key.
    assert "duplicate" in raises(p.MalformedMessage, raw_map((b"\xa1a", 1), (b"\xd9\x01a", 2))).message
    # Equal keys in different maps, and a large map of distinct keys, are fine.
    scan(frame({"a": {"a": 1}, "b": [{"a": 1}, {"a": 2}]}), p.DEFAULT_LIMITS)
    scan(frame({f"k{i}": i for i in range(256)}), p.DEFAULT_LIMITS)
    wide = frame({f"k{i}": i for i in range(255)})
    wide = b"\xde\x01\x00" + wide[3:] + frame("k200") + frame(0)  # 256 pairs, the last repeats k200
    with pytest.raises(p.MalformedMessage, match="duplicate"):
        scan(wide, p.DEFAULT_LIMITS)
    with pytest.raises(p.MalformedMessage, match="duplicate"):
        codec_module.scan_py(wide, p.DEFAULT_LIMITS)
    reply = raw_map((frame("v"), 1), (frame("id"), 1), (frame("ok"), False), (frame("ok"), True))
    with pytest.raises(p.MalformedMessage, match="duplicate"):
        p.decode_response(reply)


def test_huge_declared_lengths_do_not_allocate() -> None:
    # A bin32 header that claims 4 GiB, and an array32 that claims 2**32 - 1 items.
    raises(p.MessageTooLarge, b"\xc6\xff\xff\xff\xff")
    raises(p.MessageTooLarge, b"\xdd\xff\xff\xff\xff")
    raises(p.MalformedMessage, b"\xc6\x00\x00\x10\x00")  # within limits, but truncated


def test_scan_accepts_every_valid_message() -> None:
    for obj in (
        None,
        True,
        -(2**63),
        2**64 - 1,
        1.5,
        "é" * 10,
        b"\x00" * 300,
        [[]] * 3,
        {"a": {"b": [1, 2.0]}},
    ):
        scan(frame(obj), p.DEFAULT_LIMITS)
        scan(msgpack.packb(obj, use_single_float=True), p.DEFAULT_LIMITS)


def test_encoder_refuses_a_message_over_the_limit() -> None:
    request = p.Request(1, p.MatchRequest(tokens=range(100)))
    with pytest.raises(p.MessageTooLarge):
        p.encode_request(request, p.Limits(max_message_bytes=100))


# --- responses ---------------------------------------------------------------------------------


def response_raises(exc_type: type[p.ProtocolError], obj: Any) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_response(frame(obj))
    assert type(info.value) is exc_type, repr(info.value)


@pytest.mark.parametrize(
    "obj",
    [
        {"v": 1, "id": 1, "ok": "yes"},
        {"v": 1, "id": 1, "ok": True, "op": "step"},  # no result
        {"v": 1, "id": 1, "ok": True, "op": "nope", "result": {}},
        {"v": 1, "id": None, "ok": True, "op": "step", "result": {"round": 1}},
        {"v": 1, "id": 1, "ok": True, "op": "step", "result": {"round": -1}},
        {"v": 1, "id": 1, "ok": True, "op": "step", "result": {"round": 1}, "error": {}},
        {"v": 1, "id": 1, "ok": False, "error": {"code": 1, "name": "BAD_MESSAGE"}},
        {"v": 1, "id": 1, "ok": False, "error": {"code": "1", "name": "x", "message": "m"}},
        {"v": 1, "id": -5, "ok": False, "error": {"code": 1, "name": "x", "message": "m"}},
    ],
)
def test_bad_responses_are_malformed(obj: Any) -> None:
    response_raises(p.MalformedMessage, obj)


def test_response_with_wrong_version() -> None:
    response_raises(p.UnsupportedVersion, {"v": 9, "id": 1, "ok": True, "op": "step", "result": {"round": 1}})


def test_error_reply_without_id_round_trips() -> None:
    try:
        p.decode_request(b"\xc1")
    except p.ProtocolError as exc:
        reply = p.error_response(None, exc)
    decoded = p.decode_response(p.encode_response(reply))
    assert decoded.id is None and decoded.error is not None and decoded.error.name == "BAD_MESSAGE"
    with pytest.raises(p.MalformedMessage):
        decoded.unwrap()


def test_object_count_boundary() -> None:
    limits = p.Limits(max_objects=10)
    scan(frame([0] * 9), limits)  # the array and its 9 items: 10 objects
    with pytest.raises(p.MessageTooLarge, match="objects"):
        scan(frame([0] * 10), limits)
    with pytest.raises(p.MessageTooLarge, match="objects"):
        scan(frame({"a": [0] * 4, "b": [0] * 4}), limits)  # 1 + 4 + 8


def test_depth_boundary() -> None:
    limits = p.Limits(max_depth=3)
    scan(frame([[[]]]), limits)
    with pytest.raises(p.MessageTooLarge, match="nesting"):
        scan(frame([[[[]]]]), limits)


def test_the_servers_fast_reply_path_matches_the_checked_one() -> None:
    ids = p.as_id_array([3, 1, 2])
    fast = p.MatchResult.unchecked(48, 3, 0, 0, ids)
    checked = p.MatchResult(48, 3, 0, 0, [3, 1, 2])
    assert fast == checked
    frame_fast = p.encode_ok(9, fast)
    assert frame_fast == p.encode_response(p.ok_response(9, checked))
    assert p.decode_response(frame_fast).unwrap() == checked
    conn = p.ServerConnection()
    conn.receive(p.encode_request(p.Request(9, p.MatchRequest(tokens=[1, 2]))))
    assert conn.num_pending == 1
    assert conn.send_ok(9, fast) == frame_fast and conn.num_pending == 0
    with pytest.raises(ValueError):
        p.MatchResult.unchecked(48, 3)  # every field, in order


@pytest.mark.skipif(ids_module._ids_non_negative is None, reason="the C helper was not built")
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]))
def test_the_c_sign_check_agrees_with_the_python_one(data: bytes) -> None:
    assert ids_module._ids_non_negative(data) == data[3::4].isascii()
    for cut in range(0, len(data), 4):  # a negative id at every position is found
        flipped = data[: cut + 3] + bytes([data[cut + 3] | 0x80]) + data[cut + 4 :]
        assert not ids_module._ids_non_negative(flipped)


def _scan_outcome(fn: Any, data: bytes, limits: p.Limits) -> tuple[str, str] | None:
    try:
        fn(data, limits)
    except p.ProtocolError as exc:
        return type(exc).__name__, exc.message
    return None


_TIGHT = p.Limits(max_depth=3, max_objects=12, max_array_len=5, max_map_len=3, max_str_len=6, max_bin_len=8)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=9)
    | st.binary(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=20,
)
# Maps written pair by pair: keys repeat (few key names, some in two encodings) or are not strings.
_keys = st.sampled_from(["a", "b", ""]).map(frame) | st.sampled_from([b"\xd9\x01a", b"\xc4\x01a", b"\x01"])
_raw_maps = st.recursive(
    _scalars.map(frame),
    lambda inner: st.lists(st.tuples(_keys, inner), max_size=5).map(
        lambda pairs: bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)
    ),
    max_leaves=12,
)


@pytest.mark.skipif(codec_module._c_scan is None, reason="the C scan was not built")
@settings(max_examples=400, deadline=None)
@given(
    st.one_of(_values.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=40), _raw_maps),
    st.integers(0, 6),
)
def test_the_c_scan_agrees_with_the_python_scan(data: bytes, cut: int) -> None:
    for frame in (data, data[: len(data) - cut], data + b"\xc0" * cut):
        for limits in (p.DEFAULT_LIMITS, _TIGHT):
            assert _scan_outcome(scan, frame, limits) == _scan_outcome(codec_module.scan_py, frame, limits)


def test_limits_past_int64_counting_use_the_reference_scan() -> None:
    huge = p.Limits(max_objects=2**64, max_bin_len=2**62 + 1)  # msgpack itself takes at most ssize_t
    request = p.Request(1, p.MatchRequest(tokens=[1, 2]))
    assert p.decode_request(p.encode_request(request), huge) == request
    with pytest.raises(p.MalformedMessage, match="trailing"):
        p.decode_request(p.encode_request(request) + b"\x00", huge)


def test_encode_match_ok_without_the_c_writer_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C helpers were not built, a lookup's reply is the reference encoding of its body."""
    from array import array

    monkeypatch.setattr(codec_module, "_c_match_reply", None)
    ids = array("i", range(300))
    frame = p.encode_match_ok(9, 4800, 300, 0, 0, ids)
    assert frame == codec_module.encode_ok_py(9, p.MatchResult.unchecked(4800, 300, 0, 0, ids))
    assert p.decode_response(frame).unwrap() == p.MatchResult(4800, 300, 0, 0, list(range(300)))
