"""Error codes and the exception types that carry them.

Every failure the protocol can report has a stable number (``ErrorCode``) and one exception type.
A server turns an exception into an error reply ``{"code", "name", "message"}``; a client turns
the reply back into the same exception type with ``exception_for``. Numbers are part of the
wire format: never renumber or reuse one, only append.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Stable wire numbers of every error family."""

    BAD_MESSAGE = 1  # not msgpack, truncated, wrong envelope shape or types
    TOO_LARGE = 2  # a frame, string, array, map or object count over the limits
    UNSUPPORTED_VERSION = 3  # "v" is not a protocol version this side speaks
    UNKNOWN_OP = 4  # "op" names no operation
    BAD_ARGUMENT = 5  # the op is known but an argument is missing, unknown, mistyped or out of range
    UNAUTHORIZED = 6  # hello without the right token, or a request before hello where one is required
    CACHE_CLOSED = 7  # the cache failed closed: writes are refused until an agreed flush reopens it
    NOT_FOUND = 8  # an unknown lease, buffer or page
    OVERLOADED = 9  # too many requests in flight; retry later
    TIMEOUT = 10  # the request (or the round it waited for) did not finish in time
    INTERNAL = 11  # a bug or an unexpected failure on the server
    DUPLICATE_REQUEST = 12  # a request id that is still in flight on this connection
    NO_SPACE = 13  # a page pool has no free pages for this request


class ProtocolError(Exception):
    """Base of every protocol error. ``code`` is the wire number, ``message`` says what went wrong.

    ``request_id`` is the id of the request the error answers, when it could be read (a server
    replies with it so that the client can match the reply), else None.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return f"[{self.code.name}] {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, request_id={self.request_id!r})"


class MalformedMessage(ProtocolError):
    code = ErrorCode.BAD_MESSAGE


class MessageTooLarge(ProtocolError):
    code = ErrorCode.TOO_LARGE


class UnsupportedVersion(ProtocolError):
    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownOp(ProtocolError):
    code = ErrorCode.UNKNOWN_OP


class InvalidArgument(ProtocolError):
    code = ErrorCode.BAD_ARGUMENT


class Unauthorized(ProtocolError):
    code = ErrorCode.UNAUTHORIZED


class CacheClosed(ProtocolError):
    code = ErrorCode.CACHE_CLOSED


class NotFound(ProtocolError):
    code = ErrorCode.NOT_FOUND


class Overloaded(ProtocolError):
    code = ErrorCode.OVERLOADED


class RequestTimeout(ProtocolError):
    code = ErrorCode.TIMEOUT


class InternalError(ProtocolError):
    code = ErrorCode.INTERNAL


class DuplicateRequest(ProtocolError):
    code = ErrorCode.DUPLICATE_REQUEST


class NoSpace(ProtocolError):
    code = ErrorCode.NO_SPACE


ERROR_TYPES: dict[ErrorCode, type[ProtocolError]] = {
    cls.code: cls
    for cls in (
        MalformedMessage,
        MessageTooLarge,
        UnsupportedVersion,
        UnknownOp,
        InvalidArgument,
        Unauthorized,
        CacheClosed,
        NotFound,
        Overloaded,
        RequestTimeout,
        InternalError,
        DuplicateRequest,
        NoSpace,
    )
}


def exception_for(code: int, message: str, *, request_id: int | None = None) -> ProtocolError:
    """The exception a client raises for an error reply. A code this side does not know (a newer
    server) becomes an ``InternalError`` that keeps the number in its message."""
    try:
        cls = ERROR_TYPES[ErrorCode(code)]
    except ValueError:
        return InternalError(f"unknown error code {code}: {message}", request_id=request_id)
    return cls(message, request_id=request_id)
