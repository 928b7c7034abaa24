"""Fuzz the decoders: whatever the bytes, only ProtocolError subclasses come out."""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol as p
import protocol.messages as m
from protocol.codec import scan

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SMALL = p.Limits(
    max_message_bytes=4096,
    max_depth=4,
    max_objects=64,
    max_array_len=8,
    max_map_len=8,
    max_str_len=64,
    max_bin_len=256,
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
structures = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)
ops = st.sampled_from(sorted(p.REQUEST_TYPES)) | st.text(max_size=10)
arg_names = st.sampled_from(sorted({name for cls in p.REQUEST_TYPES.values() for name in cls.NAMES})) | st.text(
    max_size=6
)
result_names = st.sampled_from(sorted({name for cls in p.RESULT_TYPES.values() for name in cls.NAMES})) | st.text(
    max_size=6
)
id_bins = st.binary(max_size=64) | st.lists(st.integers(0, 2**31 - 1), max_size=16).map(p.pack_ids)
envelopes = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 1, 0, 2]),
        "id": st.integers(min_value=-(2**63), max_value=2**64 - 1) | scalars,
        "op": ops,
        "args": st.dictionaries(arg_names, scalars | id_bins | structures, max_size=5),
    }
)
responses = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 2]),
        "id": st.integers(min_value=0, max_value=2**64 - 1) | st.none() | scalars,
        "ok": st.booleans() | scalars,
        "op": ops,
        "result": st.dictionaries(
            result_names, scalars | id_bins | st.dictionaries(st.text(max_size=4), scalars), max_size=6
        ),
        "error": st.fixed_dictionaries({"code": st.integers(-5, 50), "name": st.text(max_size=5), "message": st.text()})
        | structures,
    }
).map(lambda d: {k: v for k, v in d.items() if not (d["ok"] is True and k == "error")})


def wire_value(kind: m.Kind) -> st.SearchStrategy[Any]:
    """Valid wire values of one field kind."""
    if isinstance(kind, m.Maybe):
        return st.none() | wire_value(kind.inner)
    if isinstance(kind, m.Int):
        return st.integers(kind.lo, kind.hi)
    if isinstance(kind, m.Text):
        return st.sampled_from(kind.choices) if kind.choices else st.text(max_size=min(kind.max_len, 12))
    if isinstance(kind, m.Flag):
        return st.booleans()
    if isinstance(kind, m.Ids):
        return st.lists(st.integers(0, 2**31 - 1), max_size=8).map(p.pack_ids)
    if isinstance(kind, m.Blob):
        return st.binary(max_size=16)
    if isinstance(kind, m.ScalarMap):
        return st.dictionaries(st.text(min_size=1, max_size=6), scalars, max_size=4)
    if isinstance(kind, m.MapList):
        return st.lists(wire_value(kind.item), max_size=3)
    raise AssertionError(f"no strategy for {kind!r}")


@st.composite
def schema_args(draw: st.DrawFn, cls: type[p.Body]) -> dict[str, Any]:
    """A map for ``cls`` where each field is mostly valid, sometimes missing or garbage, plus
    sometimes an unknown key: reaches both the accept path and every field check."""
    args: dict[str, Any] = {}
    for name, kind, _, _ in cls.SPEC:
        choice = draw(st.sampled_from(["valid"] * 6 + ["missing", "garbage"]))
        if choice == "valid":
            args[name] = draw(wire_value(kind))
        elif choice == "garbage":
            args[name] = draw(structures)
    if draw(st.integers(0, 9)) == 0:
        args[draw(st.text(max_size=6))] = draw(scalars)
    return args


schema_requests = st.sampled_from(sorted(p.REQUEST_TYPES)).flatmap(
    lambda op: st.fixed_dictionaries(
        {"v": st.just(1), "id": st.integers(0, 2**64 - 1), "op": st.just(op), "args": schema_args(p.REQUEST_TYPES[op])}
    )
)
schema_results = st.sampled_from(sorted(p.RESULT_TYPES)).flatmap(
    lambda op: st.fixed_dictionaries(
        {
            "v": st.just(1),
            "id": st.integers(0, 2**64 - 1),
            "op": st.just(op),
            "ok": st.just(True),
            "result": schema_args(p.RESULT_TYPES[op]),
        }
    )
)


def only_protocol_errors(decode: Any, data: Any, limits: p.Limits = p.DEFAULT_LIMITS) -> Any:
    try:
        return decode(data, limits)
    except p.ProtocolError as exc:
        assert isinstance(exc.code, p.ErrorCode)
        assert exc.request_id is None or 0 <= exc.request_id < 2**64
        return exc


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    only_protocol_errors(p.decode_request, data)
    only_protocol_errors(p.decode_response, data)
    only_protocol_errors(p.decode_request, data, SMALL)


@FUZZ
@given(structures)
def test_random_msgpack_structures(obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    only_protocol_errors(p.decode_request, data)
    only_protocol_errors(p.decode_response, data)
    only_protocol_errors(p.decode_request, data, SMALL)


@FUZZ
@given(envelopes | schema_requests)
def test_near_valid_requests(obj: dict[str, Any]) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    out = only_protocol_errors(p.decode_request, data)
    if isinstance(out, p.Request):
        # Anything accepted is a fully typed request that re-encodes and decodes to itself
        # (compared as bytes: a NaN in a descriptor never equals itself).
        again = p.decode_request(p.encode_request(out))
        assert type(again.body) is type(out.body) and p.encode_request(again) == p.encode_request(out)
    else:
        # The server can always answer, and the answer decodes on the client.
        reply = p.decode_response(p.encode_response(p.error_response(None, out)))
        assert reply.error is not None and reply.error.code == int(out.code)


@FUZZ
@given(responses | schema_results)
def test_near_valid_responses(obj: dict[str, Any]) -> None:
    out = only_protocol_errors(p.decode_response, msgpack.packb(obj, use_bin_type=True))
    if isinstance(out, p.Response):
        # Compare encodings, not objects: a float NaN in stats is not equal to itself.
        frame = p.encode_response(out)
        assert p.encode_response(p.decode_response(frame)) == frame


valid_frames = st.builds(
    lambda rid, tokens, pages: p.encode_request(
        p.Request(rid, p.InsertRequest(tokens=tokens, device_page_ids=pages, lease=rid))
    ),
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**31 - 1), max_size=40),
    st.lists(st.integers(0, 2**31 - 1), max_size=5),
)


@FUZZ
@given(valid_frames, st.data())
def test_mutated_valid_frames(data: bytes, draw: st.DataObject) -> None:
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        kind = draw.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw.draw(st.integers(0, max(len(buf) - 1, 0)))
        if kind == "flip" and buf:
            buf[at] ^= draw.draw(st.integers(1, 255))
        elif kind == "cut":
            del buf[at:]
        else:
            buf[at:at] = draw.draw(st.binary(min_size=1, max_size=4))
    only_protocol_errors(p.decode_request, bytes(buf))
    only_protocol_errors(p.decode_request, bytes(buf), SMALL)


@FUZZ
@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**31 - 1), max_size=200), st.text(max_size=30))
def test_match_round_trip(rid: int, tokens: list[int], namespace: str) -> None:
    request = p.Request(rid, p.MatchRequest(tokens=tokens, namespace=namespace))
    decoded = p.decode_request(p.encode_request(request))
    assert decoded == request and decoded.body.tokens == array("i", tokens)


packed_or_random = st.binary(max_size=200) | structures.map(msgpack.packb) | valid_frames


@FUZZ
@given(packed_or_random, st.integers(0, 8))
def test_scan_agrees_with_msgpack(data: bytes, cut: int) -> None:
    """The header scan accepts exactly the frames msgpack can unpack whole (without extensions)
    whose maps have distinct str keys: a scan that refused valid frames would break clients, one
    that passed bad ones would let unbounded or ambiguous input reach the unpacker."""
    data = data[: len(data) - cut] if cut % 2 else data  # half the time, truncate a little
    big = p.Limits(max_depth=10_000, max_objects=10**6, max_map_len=10**6, max_array_len=10**6)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            unicode_errors="surrogateescape",  # the scan compares keys as bytes; UTF-8 is checked later
            strict_map_key=False,
            use_list=False,
            ext_hook=_refuse_ext,
            object_pairs_hook=_distinct_str_keys,
        )
        unpacked = True
    except TypeError:  # a map used as a map key: valid msgpack that Python cannot hold
        return
    except Exception:
        unpacked = False
    try:
        scan(data, big)
        scanned = True
    except p.ProtocolError:
        scanned = False
    assert scanned == unpacked, (data, obj if unpacked else None)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError("extension")


def _distinct_str_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    keys = [k for k, _ in pairs]
    if any(type(k) is not str for k in keys) or len(set(keys)) != len(keys):
        raise ValueError("a map key that is not a str, or one that repeats")
    return dict(pairs)
