"""The msgpack codec: requests and responses to and from one frame of bytes, under hard limits.

Decoding runs in three steps, each refusing input before it costs memory:

1. the frame's length against ``Limits.max_message_bytes``;
2. a scan of the msgpack headers (no objects built) that bounds nesting depth, object count and
   every string, bin, array and map length, refuses extension types, map keys that are not
   strings and duplicate keys in one map (msgpack would keep the last: ``{"op": "health", ...,
   "op": "flush"}`` must not run flush), and finds truncation;
3. ``msgpack.unpackb`` with the same bounds, then the envelope and the op's schema.

Whatever the input, a decoder raises only ``ProtocolError`` subclasses. A decode error raised
after the request id was read carries it in ``request_id``, so the reply can still be matched.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import msgpack

from protocol.errors import (
    ErrorCode,
    InvalidArgument,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    UnknownOp,
    UnsupportedVersion,
)
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    RESULT_TYPES,
    Body,
    ErrorInfo,
    Ids,
    MatchRequest,
    MatchResult,
    Request,
    Response,
    is_u64,
)

_REQUEST_KEYS = frozenset(("v", "id", "op", "args"))
_OK_KEYS = frozenset(("v", "id", "op", "ok", "result"))
_ERROR_KEYS = frozenset(("v", "id", "ok", "error"))
_ERROR_INFO_KEYS = frozenset(("code", "name", "message"))
MAX_ERROR_MESSAGE = 1024  # characters of an error message a server sends
_LITTLE = sys.byteorder == "little"

# ---------------------------------------------------------------------------------------------
# Header scan. One table entry per first byte: (kind, length bytes that follow, fixed length).

_SCALAR, _STR, _BIN, _ARRAY, _MAP, _EXT, _INVALID = range(7)


def _header_table() -> tuple[tuple[int, int, int], ...]:
    table: list[tuple[int, int, int]] = []
    for b in range(256):
        if b <= 0x7F or b >= 0xE0:
            entry = (_SCALAR, 0, 0)  # positive and negative fixint
        elif b <= 0x8F:
            entry = (_MAP, 0, b & 0x0F)
        elif b <= 0x9F:
            entry = (_ARRAY, 0, b & 0x0F)
        elif b <= 0xBF:
            entry = (_STR, 0, b & 0x1F)
        else:
            entry = {
                0xC0: (_SCALAR, 0, 0),  # nil
                0xC1: (_INVALID, 0, 0),  # never used
                0xC2: (_SCALAR, 0, 0),  # false
                0xC3: (_SCALAR, 0, 0),  # true
                0xC4: (_BIN, 1, 0),
                0xC5: (_BIN, 2, 0),
                0xC6: (_BIN, 4, 0),
                0xC7: (_EXT, 0, 0),
                0xC8: (_EXT, 0, 0),
                0xC9: (_EXT, 0, 0),
                0xCA: (_SCALAR, 0, 4),  # float32
                0xCB: (_SCALAR, 0, 8),  # float64
                0xCC: (_SCALAR, 0, 1),  # uint8..uint64
                0xCD: (_SCALAR, 0, 2),
                0xCE: (_SCALAR, 0, 4),
                0xCF: (_SCALAR, 0, 8),
                0xD0: (_SCALAR, 0, 1),  # int8..int64
                0xD1: (_SCALAR, 0, 2),
                0xD2: (_SCALAR, 0, 4),
                0xD3: (_SCALAR, 0, 8),
                0xD9: (_STR, 1, 0),
                0xDA: (_STR, 2, 0),
                0xDB: (_STR, 4, 0),
                0xDC: (_ARRAY, 2, 0),
                0xDD: (_ARRAY, 4, 0),
                0xDE: (_MAP, 2, 0),
                0xDF: (_MAP, 4, 0),
            }.get(b, (_EXT, 0, 0))  # 0xD4..0xD8: fixext
        table.append(entry)
    return tuple(table)


_HEADERS = _header_table()


_WHAT = {
    _STR: "a string of {} bytes",
    _BIN: "a bin of {} bytes",
    _ARRAY: "an array of {} items",
    _MAP: "a map of {} pairs",
}


try:  # the same scan in C (protocol/_speedups.c), built at install where a compiler is
    from protocol._speedups import scan as _c_scan
except ImportError:
    _c_scan = None
try:  # the fast reader of a plain match request and writer of its reply (protocol/_match.c)
    from protocol._speedups import match_reply as _c_match_reply
    from protocol._speedups import match_request as _c_match_request
except ImportError:
    _c_match_request = _c_match_reply = None
_C_SCAN_MAX_DEPTH = 64
_C_SCAN_MAX_BOUND = 2**62


def scan(data: bytes | memoryview, limits: Limits) -> None:
    """Walk the msgpack headers of one frame without building objects. Raises MalformedMessage
    (truncated, trailing bytes, invalid byte, extension type, a map key that is not a str or is
    repeated in its map) or MessageTooLarge (a bound).

    Objects are counted when their container's header is read, so a frame that declares too
    many is refused before any of them is looked at. Runs in C where that was built (the same
    walk, the same errors: tests/unit/test_protocol_codec.py holds the two to each other)."""
    caps = (limits.max_str_len, limits.max_bin_len, limits.max_array_len, limits.max_map_len)
    if _c_scan is None or limits.max_depth > _C_SCAN_MAX_DEPTH or max(*caps, limits.max_objects) > _C_SCAN_MAX_BOUND:
        scan_py(data, limits)  # limits past what the C scan counts in int64 go the reference way
        return
    problem = _c_scan(data, *caps, limits.max_depth, limits.max_objects)
    if problem is None:
        return
    what = problem[0]
    if what == "too_large":
        _, kind, length, cap = problem
        raise MessageTooLarge(f"{_WHAT[kind].format(length)}, more than {cap}")
    if what == "depth":
        raise MessageTooLarge(f"nesting deeper than {limits.max_depth}")
    if what == "objects":
        raise MessageTooLarge(f"more than {limits.max_objects} msgpack objects in one frame")
    if what == "ext":
        raise MalformedMessage("msgpack extension types are not allowed")
    if what == "invalid":
        raise MalformedMessage(f"invalid msgpack byte 0x{problem[1]:02x}")
    if what == "key_type":
        raise MalformedMessage("map keys must be strings")
    if what == "duplicate_key":
        raise MalformedMessage("duplicate map key")
    if what == "trailing":
        raise MalformedMessage(f"{problem[1]} trailing bytes after the message")
    raise MalformedMessage("truncated frame")


def scan_py(data: bytes | memoryview, limits: Limits) -> None:
    """``scan`` in Python: the reference the C scan is tested against, and the fallback."""
    n = len(data)
    caps = (0, limits.max_str_len, limits.max_bin_len, limits.max_array_len, limits.max_map_len)
    max_depth, max_objects = limits.max_depth, limits.max_objects
    headers = _HEADERS
    pos = 0
    objects = 1
    remaining = 1  # objects still to read in the innermost open container
    keys: set[bytes] | None = None  # the innermost open map's keys so far (None: not in a map)
    stack: list[tuple[int, set[bytes] | None]] = []  # ``remaining`` and ``keys`` of each enclosing container
    while True:
        if not remaining:
            if not stack:
                break
            remaining, keys = stack.pop()
            continue
        # A map's items alternate key, value; its ``remaining`` count is even exactly at a key.
        is_key = keys is not None and not remaining & 1
        remaining -= 1
        if pos >= n:
            raise MalformedMessage("truncated frame")
        kind, size_bytes, length = headers[data[pos]]
        pos += 1
        if size_bytes:
            end = pos + size_bytes
            if end > n:
                raise MalformedMessage("truncated frame")
            length = int.from_bytes(data[pos:end], "big")
            pos = end
        if is_key:
            if kind != _STR:
                raise MalformedMessage("map keys must be strings")
            if length <= caps[_STR] and pos + length <= n:  # else: too large or truncated, below
                key = bytes(data[pos : pos + length])
                if key in keys:  # type: ignore[operator]
                    raise MalformedMessage("duplicate map key")
                keys.add(key)  # type: ignore[union-attr]
        if kind <= _BIN:  # scalar, str, bin: skip the payload
            if kind and length > caps[kind]:
                raise MessageTooLarge(f"{_WHAT[kind].format(length)}, more than {caps[kind]}")
            pos += length
        elif kind <= _MAP:
            if length > caps[kind]:
                raise MessageTooLarge(f"{_WHAT[kind].format(length)}, more than {caps[kind]}")
            if len(stack) >= max_depth:
                raise MessageTooLarge(f"nesting deeper than {max_depth}")
            if length:
                if kind == _MAP:
                    length *= 2
                objects += length
                if objects > max_objects:
                    raise MessageTooLarge(f"more than {max_objects} msgpack objects in one frame")
                stack.append((remaining, keys))
                remaining = length
                keys = set() if kind == _MAP else None
        elif kind == _EXT:
            raise MalformedMessage("msgpack extension types are not allowed")
        else:
            raise MalformedMessage(f"invalid msgpack byte 0x{data[pos - 1]:02x}")
    if pos > n:
        raise MalformedMessage("truncated frame")
    if pos < n:
        raise MalformedMessage(f"{n - pos} trailing bytes after the message")


def _unpack(frame: Any, limits: Limits) -> Any:
    if type(frame) is bytes:
        data: bytes | memoryview = frame
    elif isinstance(frame, (bytearray, memoryview)):
        try:
            data = memoryview(frame).cast("B")
        except TypeError:
            raise MalformedMessage("a frame must be a contiguous buffer") from None
    else:
        raise MalformedMessage(f"a frame must be bytes, got {type(frame).__name__}")
    if len(data) > limits.max_message_bytes:
        raise MessageTooLarge(f"a frame of {len(data)} bytes, more than {limits.max_message_bytes}")
    if not len(data):
        raise MalformedMessage("empty frame")
    scan(data, limits)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, UnicodeDecodeError, ...)
        raise MalformedMessage(f"not a valid msgpack message: {type(exc).__name__}: {exc}"[:200]) from None


def _pack(obj: dict[str, Any], limits: Limits) -> bytes:
    frame = msgpack.packb(obj, use_bin_type=True)
    if len(frame) > limits.max_message_bytes:
        raise MessageTooLarge(f"the encoded message is {len(frame)} bytes, more than {limits.max_message_bytes}")
    return frame


def _check_envelope(obj: Any, what: str, allowed: frozenset[str]) -> int | None:
    """The frame's request id if readable; raises UnsupportedVersion / MalformedMessage."""
    if type(obj) is not dict:
        raise MalformedMessage(f"a {what} must be a msgpack map, got {type(obj).__name__}")
    rid = obj.get("id")
    request_id = rid if is_u64(rid) else None
    version = obj.get("v")
    if "v" not in obj:
        raise MalformedMessage(f'a {what} needs "v" (the protocol version)', request_id=request_id)
    if type(version) is not int:
        raise MalformedMessage(f'"v" must be an int, got {type(version).__name__}', request_id=request_id)
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {version} is not supported; this side speaks {PROTOCOL_VERSION}",
            request_id=request_id,
        )
    unknown = obj.keys() - allowed
    if unknown:
        names = ", ".join(sorted(repr(k)[:40] for k in unknown)[:8])
        raise MalformedMessage(f"unknown {what} key(s) {names}", request_id=request_id)
    return request_id


# ---------------------------------------------------------------------------------------------
# Requests.


def encode_request(request: Request, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One frame. Raises MessageTooLarge when it would exceed ``limits.max_message_bytes``."""
    return _pack(
        {"v": PROTOCOL_VERSION, "id": request.id, "op": request.body.OP, "args": request.body.to_wire()},
        limits,
    )


def _fast_match_allowed(limits: Limits) -> bool:
    """Whether the C reader is there and every bound but the frame's, the bin's and the id count's
    admits any frame it reads (4 envelope keys, at most 3 arguments, keys of at most 9 bytes,
    depth 2, 14 objects)."""
    if limits is DEFAULT_LIMITS:
        return _FAST_MATCH
    return _c_match_request is not None and (
        limits.max_depth >= 2 and limits.max_objects >= 14 and limits.max_map_len >= 4 and limits.max_str_len >= 9
    )


_FAST_MATCH = _fast_match_allowed(Limits())


def decode_request(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Request:
    """The request in one frame. Raises only ProtocolError subclasses; ``request_id`` is set on
    the error whenever the frame's id could be read.

    A plain match request (``decode_match``) is read by the C reader where it was built; any other
    frame, and any frame it declines, takes the general path (``decode_request_py``), which decides
    every error."""
    request = decode_match(frame, limits) if type(frame) is bytes else None
    return request if request is not None else decode_request_py(frame, limits)


def decode_match(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Request | None:
    """The request in ``frame`` when it is a plain match request, read in C: exactly the keys
    ``v`` (1), ``id``, ``op`` ("match") and ``args`` with ``tokens`` and optionally an empty
    ``namespace`` and a nil or bool ``storage``, within ``limits``, ids non-negative. None for
    anything else, or without the C reader (then ``decode_request_py`` reads the frame the same
    way, or raises)."""
    if len(frame) > limits.max_message_bytes or not _fast_match_allowed(limits):
        return None
    found = _c_match_request(frame, limits.max_bin_len, limits.max_ids)
    if found is None:
        return None
    request_id, tokens, storage = found
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        tokens.byteswap()
    body = _new(MatchRequest)
    _set_tokens(body, tokens)
    _set_namespace(body, "")
    _set_storage(body, storage)
    return _trusted_request(request_id, body)


def match_tokens(frame: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[int, bytes, bool | None] | None:
    """``(id, tokens, storage)`` of a plain match request (as ``decode_match`` reads it), the tokens
    as their wire bytes (little-endian int32, the form a cache keys pages by) copied once out of
    ``frame``, which may be any buffer (a transport's own frame: no copy of the whole frame first).
    None for anything else, on a big-endian host, or without the C reader: the caller then decodes
    the frame the general way (``decode_request``), which reads it as the same request."""
    allowed = _FAST_MATCH if limits is DEFAULT_LIMITS else _fast_match_allowed(limits)  # (a call less per frame)
    if not allowed or not _LITTLE or len(frame) > limits.max_message_bytes:
        return None
    found: tuple[int, bytes, bool | None] | None = _c_match_request(frame, limits.max_bin_len, limits.max_ids, True)
    return found


# The slots' own descriptors: writes that skip the frozen __setattr__ (the fast reader checked every field).
_new = object.__new__
_set_tokens = MatchRequest.tokens.__set__  # type: ignore[attr-defined]
_set_namespace = MatchRequest.namespace.__set__  # type: ignore[attr-defined]
_set_storage = MatchRequest.storage.__set__  # type: ignore[attr-defined]


def decode_request_py(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Request:
    """``decode_request`` without the fast match reader: the reference every frame can take."""
    obj = _unpack(frame, limits)
    request_id = _check_envelope(obj, "request", _REQUEST_KEYS)
    if request_id is None:
        raise MalformedMessage('a request needs "id", an int in [0, 2**64 - 1]')
    try:
        op = obj.get("op")
        if type(op) is not str:
            raise MalformedMessage(f'a request needs "op", a str, got {type(op).__name__}')
        cls = REQUEST_TYPES.get(op)
        if cls is None:
            raise UnknownOp(f"unknown op {op[:64]!r}; known ops: {', '.join(sorted(REQUEST_TYPES))}")
        if "args" not in obj:
            raise MalformedMessage('a request needs "args", a map ({} when the op takes none)')
        body = cls.from_wire(obj["args"], limits)
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    return _trusted_request(request_id, body)


def _trusted_request(request_id: int, body: Body) -> Request:
    # Both parts were checked by the decoder; skip Request.__post_init__ (hot path).
    request = object.__new__(Request)
    object.__setattr__(request, "id", request_id)
    object.__setattr__(request, "body", body)
    return request


# ---------------------------------------------------------------------------------------------
# Responses.


def ok_response(request_id: int, result: Body) -> Response:
    return Response(request_id, result=result)


def error_response(request_id: int | None, exc: BaseException) -> Response:
    """The error reply for ``exc``. A ProtocolError keeps its code and message; anything else is
    INTERNAL with only its type name, so internals do not leak to clients. With ``request_id``
    None, the id the decoder attached to ``exc`` (if any) is used."""
    if request_id is None:
        request_id = getattr(exc, "request_id", None)
        if not is_u64(request_id):
            request_id = None
    if isinstance(exc, ProtocolError):
        code, message = exc.code, exc.message
    else:
        code, message = ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})"
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[: MAX_ERROR_MESSAGE - 3] + "..."
    return Response(request_id, error=ErrorInfo(int(code), code.name, message))


def encode_response(response: Response, limits: Limits = DEFAULT_LIMITS) -> bytes:
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": response.id}
    if response.error is None:
        assert response.result is not None
        obj.update(op=response.result.OP, ok=True, result=response.result.to_wire())
    else:
        err = response.error
        obj.update(ok=False, error={"code": err.code, "name": err.name, "message": err.message})
    return _pack(obj, limits)


def encode_ok(request_id: int, result: Body, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The frame of a successful reply, without building a Response (the server's hot path;
    ``request_id`` is the id of a request it decoded)."""
    if type(result) is MatchResult and _c_match_reply is not None and _LITTLE:
        r: MatchResult = result
        return encode_match_ok(
            request_id, r.hit_tokens, r.device_pages, r.host_pages, r.storage_pages, r.device_page_ids, limits
        )
    return encode_ok_py(request_id, result, limits)


def encode_match_ok(
    request_id: int,
    hit_tokens: int,
    device_pages: int,
    host_pages: int,
    storage_pages: int,
    device_page_ids: Any,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """``encode_ok`` of ``MatchResult(hit_tokens, ..., device_page_ids)`` from its fields, without
    the body (a server's lookups; the counts are its cache's, ``device_page_ids`` an ``array('i')``
    or any ids ``Ids`` takes): the same frame, written by the C writer where there is one."""
    if _c_match_reply is None or not _LITTLE:
        body = MatchResult.unchecked(hit_tokens, device_pages, host_pages, storage_pages, device_page_ids)
        return encode_ok_py(request_id, body, limits)
    ids = device_page_ids
    if type(ids) is not array or ids.typecode != "i":  # an array('i') is copied as is, anything else checked
        ids = Ids().to_wire(ids)
    frame: bytes = _c_match_reply(request_id, hit_tokens, device_pages, host_pages, storage_pages, ids)
    if len(frame) > limits.max_message_bytes:
        raise MessageTooLarge(f"the encoded message is {len(frame)} bytes, more than {limits.max_message_bytes}")
    return frame


def encode_ok_py(request_id: int, result: Body, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """``encode_ok`` without the C writer of match replies: the reference encoding."""
    if RESULT_TYPES.get(result.OP) is not type(result):
        raise InvalidArgument(f"{type(result).__name__} is not a result body")
    obj = {"v": PROTOCOL_VERSION, "id": request_id, "op": result.OP, "ok": True, "result": result.to_wire()}
    return _pack(obj, limits)


def decode_response(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Response:
    """The response in one frame. Raises only ProtocolError subclasses (a bad result from the
    server is a MalformedMessage). An error reply is returned, not raised: see Response.unwrap."""
    obj = _unpack(frame, limits)
    if type(obj) is not dict:
        raise MalformedMessage(f"a response must be a msgpack map, got {type(obj).__name__}")
    ok = obj.get("ok")
    if type(ok) is not bool:
        raise MalformedMessage('a response needs "ok", a bool')
    request_id = _check_envelope(obj, "response", _OK_KEYS if ok else _ERROR_KEYS)
    if obj.get("id") is not None and request_id is None:
        raise MalformedMessage('a response "id" must be nil or an int in [0, 2**64 - 1]')
    try:
        if ok:
            if request_id is None:
                raise MalformedMessage("a successful response needs the request id")
            op = obj.get("op")
            cls = RESULT_TYPES.get(op) if type(op) is str else None
            if cls is None:
                raise MalformedMessage(f"a successful response names no known op: {str(op)[:64]!r}")
            if "result" not in obj:
                raise MalformedMessage('a successful response needs "result"')
            try:
                result = cls.from_wire(obj["result"], limits)
            except InvalidArgument as exc:
                raise MalformedMessage(f"bad result from the server: {exc.message}") from None
            return Response(request_id, result=result)
        return Response(request_id, error=_error_info(obj.get("error")))
    except ProtocolError as exc:
        exc.request_id = request_id
        raise


def _error_info(raw: Any) -> ErrorInfo:
    if type(raw) is not dict or raw.keys() != _ERROR_INFO_KEYS:
        raise MalformedMessage('an error response needs "error": {"code", "name", "message"}')
    code, name, message = raw["code"], raw["name"], raw["message"]
    if type(code) is not int or type(name) is not str or type(message) is not str:
        raise MalformedMessage("error code must be an int, name and message str")
    return ErrorInfo(code, name, message)


__all__ = [
    "MAX_ERROR_MESSAGE",
    "decode_match",
    "match_tokens",
    "encode_match_ok",
    "decode_request",
    "decode_request_py",
    "decode_response",
    "encode_request",
    "encode_ok",
    "encode_ok_py",
    "encode_response",
    "error_response",
    "ok_response",
    "scan",
    "scan_py",
]
