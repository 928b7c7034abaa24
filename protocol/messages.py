"""Protocol messages: one frozen dataclass per request body and per result body, plus envelopes.

On the wire (a msgpack map per frame; protocol/README.md has the full table):

    request   {"v": 1, "id": u64, "op": str, "args": {...}}
    response  {"v": 1, "id": u64, "op": str, "ok": true, "result": {...}}
              {"v": 1, "id": u64 | nil, "ok": false, "error": {"code": int, "name": str, "message": str}}

Every body field is declared with a ``Kind`` that checks a Python value when the dataclass is
built and a wire value when it is decoded. Missing required keys, unknown keys, wrong types and
out-of-range values raise ``InvalidArgument`` (sizes over the limits ``MessageTooLarge``), so
code that receives a body never touches a raw dict. Bodies are immutable: id arrays are
``array('i')`` (do not mutate them), maps are read-only ``MappingProxyType``.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from protocol.errors import InvalidArgument, MessageTooLarge, ProtocolError, exception_for
from protocol.ids import as_id_array, pack_ids, unpack_ids
from protocol.limits import Limits

PROTOCOL_VERSION = 1

# How a server routes each op; the catalogue below declares it per request body.
LOCAL = "local"  # answered by the leader alone from its own state; never sequenced
SEQUENCED = "sequenced"  # numbered and applied by every rank in order; the leader's answer speaks for all
GATHERED = "gathered"  # sequenced, and the reply joins every rank's own answer
ROUTES = (LOCAL, SEQUENCED, GATHERED)

U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
COUNT_MAX = I64_MAX  # page and token counts in results


def is_u64(value: object) -> bool:
    """True for an int (not a bool) in [0, 2**64 - 1]: request ids and lease ids."""
    return type(value) is int and 0 <= value <= U64_MAX


# ---------------------------------------------------------------------------------------------
# Field kinds: how one field is checked and carried.


class Kind:
    """One field's type. ``check`` takes a Python value and returns its canonical form;
    ``from_wire`` does the same for a decoded msgpack value under the decoder's limits."""

    def check(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value

    def from_wire(self, raw: Any, where: str, limits: Limits) -> Any:
        return self.check(raw, where)


def _type_error(where: str, expected: str, value: object) -> InvalidArgument:
    return InvalidArgument(f"{where}: expected {expected}, got {type(value).__name__}")


class Int(Kind):
    """An int in [lo, hi]; bools are refused (msgpack keeps them apart, so must we)."""

    def __init__(self, lo: int = 0, hi: int = U64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _type_error(where, "int", value)
        if not self.lo <= value <= self.hi:
            raise InvalidArgument(f"{where}: {value} is outside [{self.lo}, {self.hi}]")
        return int(value)


class Text(Kind):
    """A str of at most ``max_len`` characters, optionally one of ``choices``."""

    def __init__(self, max_len: int, choices: tuple[str, ...] = ()) -> None:
        self.max_len, self.choices = max_len, choices

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise _type_error(where, "str", value)
        if len(value) > self.max_len:
            raise InvalidArgument(f"{where}: {len(value)} characters, more than {self.max_len}")
        if self.choices and value not in self.choices:
            raise InvalidArgument(f"{where}: {value!r} is not one of {list(self.choices)}")
        return str(value)


class Flag(Kind):
    def check(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            raise _type_error(where, "bool", value)
        return value


class Ids(Kind):
    """Non-negative int32 ids: ``array('i')`` in Python, little-endian bytes on the wire."""

    def check(self, value: Any, where: str) -> array:
        return as_id_array(value, where=where)

    def to_wire(self, value: array) -> bytes:
        return pack_ids(value)

    def from_wire(self, raw: Any, where: str, limits: Limits) -> array:
        return unpack_ids(raw, max_count=limits.max_ids, where=where)


class Blob(Kind):
    """Raw bytes (inline page payloads), at most ``Limits.max_inline_bytes`` when decoded."""

    def check(self, value: Any, where: str) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise _type_error(where, "bytes", value)
        return value if type(value) is bytes else bytes(value)

    def from_wire(self, raw: Any, where: str, limits: Limits) -> bytes:
        if type(raw) is not bytes:
            raise _type_error(where, "bin", raw)
        if len(raw) > limits.max_inline_bytes:
            raise MessageTooLarge(f"{where}: {len(raw)} bytes, more than {limits.max_inline_bytes}")
        return raw


class Maybe(Kind):
    """``inner`` or None; None is left out of the wire map and an absent key reads as None."""

    def __init__(self, inner: Kind) -> None:
        self.inner = inner

    def check(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.check(value, where)

    def to_wire(self, value: Any) -> Any:
        return self.inner.to_wire(value)

    def from_wire(self, raw: Any, where: str, limits: Limits) -> Any:
        return None if raw is None else self.inner.from_wire(raw, where, limits)


_SCALARS = (type(None), bool, int, float, str)


class ScalarMap(Kind):
    """A flat map from str keys to nil/bool/int/float/str (and bytes if ``allow_bytes``): stats,
    settings, buffer descriptors. Kept with sorted keys, so its encoding is deterministic."""

    def __init__(self, max_items: int, allow_bytes: bool = False, max_key_len: int = 128) -> None:
        self.max_items, self.max_key_len = max_items, max_key_len
        self.types = _SCALARS + (bytes,) if allow_bytes else _SCALARS

    def check(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise _type_error(where, "map", value)
        if len(value) > self.max_items:
            raise MessageTooLarge(f"{where}: {len(value)} entries, more than {self.max_items}")
        items = []
        for key, item in value.items():
            if not isinstance(key, str) or not 0 < len(key) <= self.max_key_len:
                raise InvalidArgument(f"{where}: keys must be non-empty str of <= {self.max_key_len} chars")
            if type(item) not in self.types:
                raise InvalidArgument(f"{where}[{key!r}]: {type(item).__name__} is not an allowed value type")
            if type(item) is int and not I64_MIN <= item <= U64_MAX:
                raise InvalidArgument(f"{where}[{key!r}]: {item} does not fit 64 bits")
            items.append((key, item))
        items.sort(key=lambda kv: kv[0])
        return MappingProxyType(dict(items))

    def to_wire(self, value: Mapping[str, Any]) -> dict[str, Any]:
        return dict(value)


class MapList(Kind):
    """A list of ``ScalarMap`` entries, kept as a tuple."""

    def __init__(self, item: ScalarMap, max_items: int) -> None:
        self.item, self.max_items = item, max_items

    def check(self, value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
        if not isinstance(value, (list, tuple)):
            raise _type_error(where, "list", value)
        if len(value) > self.max_items:
            raise MessageTooLarge(f"{where}: {len(value)} entries, more than {self.max_items}")
        return tuple(self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value))

    def to_wire(self, value: tuple[Mapping[str, Any], ...]) -> list[dict[str, Any]]:
        return [self.item.to_wire(v) for v in value]


def _field(kind: Kind, default: Any = MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"kind": kind})


U64 = Int(0, U64_MAX)
COUNT = Int(0, COUNT_MAX)
NAMESPACE = Text(256)


# ---------------------------------------------------------------------------------------------
# Bodies.


_UNCHECKED: dict[type, Callable[..., Any]] = {}


def _unchecked_maker(cls: type[Body]) -> Callable[..., Any]:
    """A function of the fields' values, in order, that makes a ``cls`` without checks: the slots'
    own descriptors write each field (skipping the frozen __setattr__), one call per field, unrolled
    (as dataclasses writes __init__): a result body is made once per reply."""
    names = [name for name, _, _, _ in cls.SPEC]
    scope: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    scope.update({f"_set{i}": getattr(cls, name).__set__ for i, name in enumerate(names)})
    args = ", ".join(f"v{i}" for i in range(len(names)))
    body = "".join(f"    _set{i}(obj, v{i})\n" for i in range(len(names)))
    exec(f"def make({args}):\n    obj = _new(_cls)\n{body}    return obj\n", scope)  # noqa: S102 - our own field names
    return scope["make"]  # type: ignore[no-any-return]


class Body:
    """Base of request and result bodies. Subclasses are frozen, slotted dataclasses whose every
    field carries a Kind; ``register`` fills the class-level tables below."""

    __slots__ = ()
    OP: ClassVar[str] = ""
    WHERE: ClassVar[str] = ""  # prefix of error messages: "match" or "match result"
    SPEC: ClassVar[tuple[tuple[str, Kind, Any, str], ...]] = ()  # name, kind, default, "op.name"
    NAMES: ClassVar[frozenset[str]] = frozenset()
    ROUTE: ClassVar[str] = SEQUENCED  # request bodies: how a server routes the op (LOCAL, ...)

    def __post_init__(self) -> None:
        for name, kind, _, where in self.SPEC:
            value = getattr(self, name)
            checked = kind.check(value, where)
            if checked is not value:
                object.__setattr__(self, name, checked)
        self.validate()

    def validate(self) -> None:
        """Checks that span fields; raises InvalidArgument. Runs after construction and decode."""

    def route(self) -> str:
        """How a server routes this request (``ROUTE``; an op whose route depends on its
        arguments overrides this)."""
        return self.ROUTE

    @classmethod
    def unchecked(cls, *values: Any) -> Body:
        """A body from field values its caller produced and knows to be canonical (a server's own
        results: counts from its cache, ids as ``array('i')``), in field order, without the
        per-field checks. Anything that crosses a trust boundary goes through the constructor."""
        make = _UNCHECKED.get(cls)
        if make is None:
            make = _UNCHECKED[cls] = _unchecked_maker(cls)
        try:
            return make(*values)  # type: ignore[no-any-return]
        except TypeError:
            if len(values) != len(cls.SPEC):
                raise ValueError(f"{cls.__name__}.unchecked takes all {len(cls.SPEC)} fields, in order") from None
            raise

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kind, _, _ in self.SPEC:
            value = getattr(self, name)
            if value is not None:
                out[name] = kind.to_wire(value)
        return out

    @classmethod
    def from_wire(cls, raw: Any, limits: Limits) -> Body:
        """The body held by a decoded args/result map, every field checked under ``limits``."""
        if type(raw) is not dict:
            raise InvalidArgument(f"{cls.WHERE}: arguments must be a map, got {type(raw).__name__}")
        obj = object.__new__(cls)  # fields are checked here, so __init__'s checks are skipped
        found = 0
        for name, kind, default, where in cls.SPEC:
            if name in raw:
                value = kind.from_wire(raw[name], where, limits)
                found += 1
            elif default is MISSING:
                raise InvalidArgument(f"{cls.WHERE}: missing required argument {name!r}")
            else:
                value = default
            object.__setattr__(obj, name, value)
        if found != len(raw):
            names = sorted(repr(k)[:40] for k in raw.keys() - cls.NAMES)[:8]
            raise InvalidArgument(f"{cls.WHERE}: unknown argument(s) {', '.join(names)}")
        obj.validate()
        return obj


REQUEST_TYPES: dict[str, type[Body]] = {}
RESULT_TYPES: dict[str, type[Body]] = {}

B = TypeVar("B", bound=type[Body])


def _describe(cls: type[Body], op: str, where: str) -> None:
    cls.OP, cls.WHERE = op, where
    cls.SPEC = tuple((f.name, f.metadata["kind"], f.default, f"{where}.{f.name}") for f in dataclasses.fields(cls))
    cls.NAMES = frozenset(spec[0] for spec in cls.SPEC)


def register(op: str, result: type[Body], route: str = SEQUENCED) -> Callable[[B], B]:
    """Class decorator: ``cls`` is the request body of ``op``, ``result`` its result body and
    ``route`` how a server routes it (one of ``ROUTES``)."""

    def decorate(cls: B) -> B:
        if op in REQUEST_TYPES:
            raise ValueError(f"op {op!r} registered twice")
        if route not in ROUTES:
            raise ValueError(f"op {op!r}: route {route!r} is not one of {ROUTES}")
        _describe(cls, op, op)
        cls.ROUTE = route
        _describe(result, op, f"{op} result")
        REQUEST_TYPES[op], RESULT_TYPES[op] = cls, result
        return cls

    return decorate


@dataclass(frozen=True, slots=True)
class HelloResult(Body):
    protocol_version: int = _field(Int(0, 2**16))
    server: str = _field(Text(256))  # server software and version
    world_size: int = _field(Int(1, 2**16))
    page_size: int = _field(Int(1, 2**31 - 1))  # tokens per page
    layout: str = _field(Text(1024))  # KV layout descriptor; a client checks it matches its buffers
    max_message_bytes: int = _field(Int(1, U64_MAX))


@register("hello", HelloResult, LOCAL)
@dataclass(frozen=True, slots=True)
class HelloRequest(Body):
    token: str | None = _field(Maybe(Text(1024)), None)  # shared secret, when the server needs one
    client: str = _field(Text(256), "")  # free-form client name, for logs


@dataclass(frozen=True, slots=True)
class MatchResult(Body):
    hit_tokens: int = _field(COUNT)
    device_pages: int = _field(COUNT)
    host_pages: int = _field(COUNT)
    storage_pages: int = _field(COUNT)
    device_page_ids: array = _field(Ids())  # the device-resident prefix, in order


@register("match", MatchResult, LOCAL)
@dataclass(frozen=True, slots=True)
class MatchRequest(Body):
    """The cached prefix of ``tokens``. With ``storage``, also the continuation every rank finds
    in storage (a lookup through the storage tier: sequenced, answered after the round that
    agreed it); without, ``storage_pages`` is 0 and rank 0 answers alone."""

    tokens: array = _field(Ids())
    namespace: str = _field(NAMESPACE, "")
    storage: bool | None = _field(Maybe(Flag()), None)

    def route(self) -> str:
        return SEQUENCED if self.storage else LOCAL


# Why a lock's ``storage_pages`` are not all in ``ready_pages`` ("" when they are, or none were found).
STORAGE_REASONS = (
    "",
    "reading",  # still being read when the reply left (best_effort, or the timeout came): prefetch waits
    "no_host_space",  # the host tier had no free slots for them
    "read_failed",  # a rank's read came back short (missing, damaged, I/O error) after the capped retries
    "closed",  # the cache closed
)


@dataclass(frozen=True, slots=True)
class LockResult(Body):
    """``hit_tokens`` counts the device and host hits and the storage pages already read to host
    (``ready_pages``); ``load`` brings the host and storage ones to device. ``ready_pages`` and
    ``storage_reason`` are None when the lock looked nothing up in storage."""

    lease: int = _field(U64)
    hit_tokens: int = _field(COUNT)
    device_pages: int = _field(COUNT)
    host_pages: int = _field(COUNT)
    storage_pages: int = _field(COUNT)  # the continuation every rank found in storage (agreed)
    device_page_ids: array = _field(Ids())
    # With a storage lookup (else None, left off the wire): of storage_pages, those read to host
    # (pinned for the lease), and why the rest is not.
    ready_pages: int | None = _field(Maybe(COUNT), None)
    storage_reason: str | None = _field(Maybe(Text(16, choices=STORAGE_REASONS)), None)


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # when a storage read lets a reply go


@register("lock", LockResult)
@dataclass(frozen=True, slots=True)
class LockRequest(Body):
    """Match and pin the matched prefix under a new lease, atomically. ``prefetch`` (a policy, or
    "none") also looks the rest up in storage and reads what every rank holds to host, replying
    as the policy says (see PrefetchRequest); unset: the server's ``storage_prefetch`` setting."""

    tokens: array = _field(Ids())
    namespace: str = _field(NAMESPACE, "")
    prefetch: str | None = _field(Maybe(Text(16, choices=(*PREFETCH_POLICIES, "none"))), None)
    timeout_rounds: int | None = _field(Maybe(Int(0, 2**31 - 1)), None)


@dataclass(frozen=True, slots=True)
class ReleaseResult(Body):
    pass


@register("release", ReleaseResult)
@dataclass(frozen=True, slots=True)
class ReleaseRequest(Body):
    """Finish a lease: its pins and slots are freed in a round, after its copies complete."""

    lease: int = _field(U64)


@dataclass(frozen=True, slots=True)
class AbortResult(Body):
    pass


@register("abort", AbortResult)
@dataclass(frozen=True, slots=True)
class AbortRequest(Body):
    """Give up a lease: like release, but pages allocated and not yet inserted are discarded."""

    lease: int = _field(U64)


@dataclass(frozen=True, slots=True)
class InsertResult(Body):
    inserted_pages: int = _field(COUNT)
    duplicate_pages: int = _field(COUNT)  # already cached; the caller's copies of them are not kept


@register("insert", InsertResult)
@dataclass(frozen=True, slots=True)
class InsertRequest(Body):
    """Insert ``tokens`` whose KV is in ``device_page_ids`` (one page per page_size tokens)."""

    tokens: array = _field(Ids())
    device_page_ids: array = _field(Ids())
    lease: int | None = _field(Maybe(U64), None)
    namespace: str = _field(NAMESPACE, "")


@dataclass(frozen=True, slots=True)
class AppendResult(Body):
    inserted_pages: int = _field(COUNT)
    duplicate_pages: int = _field(COUNT)  # as insert's


@register("append", AppendResult)
@dataclass(frozen=True, slots=True)
class AppendRequest(Body):
    """Insert the full pages of ``tokens``, which follow what the lease's last insert or append
    cached (a running request's new pages, alone); ``device_page_ids[i]`` holds page i of them."""

    tokens: array = _field(Ids())
    device_page_ids: array = _field(Ids())
    lease: int = _field(U64)
    namespace: str = _field(NAMESPACE, "")


@dataclass(frozen=True, slots=True)
class AllocResult(Body):
    device_page_ids: array = _field(Ids())


@register("alloc", AllocResult)
@dataclass(frozen=True, slots=True)
class AllocRequest(Body):
    """Allocate device pages under a lease; the engine writes KV into them, then inserts."""

    lease: int = _field(U64)
    num_pages: int = _field(Int(1, 2**31 - 1))


@dataclass(frozen=True, slots=True)
class LoadResult(Body):
    device_page_ids: array = _field(Ids())  # the lease's hit on device, in order: every page readable


@register("load", LoadResult)
@dataclass(frozen=True, slots=True)
class LoadRequest(Body):
    """Load the lease's host-resident pages (host hits, and storage pages a prefetch read to host)
    back to the device. The reply comes once every rank agreed the copies landed: each page it
    lists holds its KV (``get_pages`` reads it); a page whose copy failed is left out, with the
    pages after it."""

    lease: int = _field(U64)


@dataclass(frozen=True, slots=True)
class PrefetchResult(Body):
    status: str = _field(Text(16, choices=("none", "running", "done")))  # "none": nothing to fetch
    storage_pages: int = _field(COUNT)  # the continuation every rank found in storage (agreed)
    ready_pages: int = _field(COUNT)  # of those, pages landed in host (``load`` brings them to device)
    storage_reason: str | None = _field(Maybe(Text(16, choices=STORAGE_REASONS)), None)  # why not all (as lock's)


@register("prefetch", PrefetchResult)
@dataclass(frozen=True, slots=True)
class PrefetchRequest(Body):
    """Look the rest of the lease's prefix up in storage and read what every rank holds to host,
    with paced, capped retries. The reply comes after the lookup was agreed, and then as
    ``policy`` says: ``best_effort`` at once, ``wait_complete`` once every read landed or gave
    up, ``timeout`` at the latest after ``timeout_rounds`` rounds. Then ``load`` the lease."""

    lease: int = _field(U64)
    policy: str = _field(Text(16, choices=PREFETCH_POLICIES), "wait_complete")
    timeout_rounds: int = _field(Int(0, 2**31 - 1), 8)


@dataclass(frozen=True, slots=True)
class StepResult(Body):
    round: int = _field(U64)  # the round that just committed


@register("step", StepResult)
@dataclass(frozen=True, slots=True)
class StepRequest(Body):
    pass


@dataclass(frozen=True, slots=True)
class FlushResult(Body):
    round: int = _field(U64)


@register("flush", FlushResult)
@dataclass(frozen=True, slots=True)
class FlushRequest(Body):
    """Agreed reset: every rank empties its cache in the same round; reopens a closed cache."""


@dataclass(frozen=True, slots=True)
class StatsResult(Body):
    values: Mapping[str, Any] = _field(ScalarMap(max_items=1024))


@register("stats", StatsResult, GATHERED)
@dataclass(frozen=True, slots=True)
class StatsRequest(Body):
    pass


@dataclass(frozen=True, slots=True)
class HealthResult(Body):
    state: str = _field(Text(16, choices=("open", "closed")))
    reason: str = _field(Text(4096))  # why the cache closed; "" while open
    round: int = _field(U64)


@register("health", HealthResult, LOCAL)
@dataclass(frozen=True, slots=True)
class HealthRequest(Body):
    pass


@dataclass(frozen=True, slots=True)
class SetConfigResult(Body):
    settings: Mapping[str, Any] = _field(ScalarMap(max_items=256))  # every runtime setting, after


@register("set_config", SetConfigResult)
@dataclass(frozen=True, slots=True)
class SetConfigRequest(Body):
    """Change runtime settings; a field left None is unchanged. At least one must be set.
    To add a setting: add a Maybe(...) field here and document it in protocol/README.md."""

    retention_cap_tokens: int | None = _field(Maybe(Int(-1, I64_MAX)), None)  # -1: no cap
    mirror_release: bool | None = _field(Maybe(Flag()), None)
    storage_prefetch: bool | None = _field(Maybe(Flag()), None)

    def validate(self) -> None:
        if all(getattr(self, spec[0]) is None for spec in self.SPEC):
            raise InvalidArgument("set_config: no setting given")


@dataclass(frozen=True, slots=True)
class RegisterBuffersResult(Body):
    registered: int = _field(COUNT)


@register("register_buffers", RegisterBuffersResult, GATHERED)
@dataclass(frozen=True, slots=True)
class RegisterBuffersRequest(Body):
    """Data plane: the client's KV buffers, one descriptor per rank (and per buffer), e.g.
    {"rank": 0, "kind": "shm", "name": "/tpcache-kv-0", "size": 1048576} or
    {"rank": 1, "kind": "cuda_ipc", "handle": b"...", "device": 1, "size": ...}. The service
    interprets the keys; the protocol only bounds them."""

    descriptors: tuple[Mapping[str, Any], ...] = _field(
        MapList(ScalarMap(max_items=64, allow_bytes=True), max_items=1024)
    )

    def validate(self) -> None:
        if not self.descriptors:
            raise InvalidArgument("register_buffers: no descriptor given")


@dataclass(frozen=True, slots=True)
class PutPagesResult(Body):
    written_pages: int = _field(COUNT)


@register("put_pages", PutPagesResult, GATHERED)
@dataclass(frozen=True, slots=True)
class PutPagesRequest(Body):
    """Inline page payload, for tests: ``data`` is the pages' bytes in ``page_ids`` order, an
    equal share per page, into pages ``lease`` allocated (a server refuses any other page)."""

    page_ids: array = _field(Ids())
    data: bytes = _field(Blob())
    lease: int | None = _field(Maybe(U64), None)

    def validate(self) -> None:
        pages, size = len(self.page_ids), len(self.data)
        if (size % pages if pages else size) != 0:
            raise InvalidArgument(f"put_pages: {size} bytes do not split evenly into {pages} pages")


@dataclass(frozen=True, slots=True)
class GetPagesResult(Body):
    data: bytes = _field(Blob())


@register("get_pages", GetPagesResult, GATHERED)
@dataclass(frozen=True, slots=True)
class GetPagesRequest(Body):
    """Inline read, for tests: pages cached on every rank, or pages the caller's ``lease`` holds."""

    page_ids: array = _field(Ids())
    lease: int | None = _field(Maybe(U64), None)


# ---------------------------------------------------------------------------------------------
# Envelopes.


@dataclass(frozen=True, slots=True)
class Request:
    """One request: a client-chosen id (unique among its requests in flight) and a body."""

    id: int
    body: Body

    def __post_init__(self) -> None:
        if not is_u64(self.id):
            raise InvalidArgument(f"request id must be an int in [0, 2**64 - 1], got {self.id!r}")
        if REQUEST_TYPES.get(getattr(self.body, "OP", "")) is not type(self.body):
            raise InvalidArgument(f"{type(self.body).__name__} is not a request body")

    @property
    def op(self) -> str:
        return self.body.OP


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """The ``error`` map of a failed response."""

    code: int
    name: str
    message: str

    def __post_init__(self) -> None:
        if type(self.code) is not int or not isinstance(self.name, str) or not isinstance(self.message, str):
            raise InvalidArgument("ErrorInfo needs an int code and str name and message")

    def exception(self, request_id: int | None = None) -> ProtocolError:
        return exception_for(self.code, self.message, request_id=request_id)


@dataclass(frozen=True, slots=True)
class Response:
    """A reply: exactly one of ``result`` (a result body) and ``error``. ``id`` is the request's
    id, or None when the server could not read one from the frame it rejects."""

    id: int | None
    result: Body | None = None
    error: ErrorInfo | None = None

    def __post_init__(self) -> None:
        if (self.result is None) == (self.error is None):
            raise InvalidArgument("a response has exactly one of result and error")
        if self.error is not None and not isinstance(self.error, ErrorInfo):
            raise InvalidArgument(f"error must be an ErrorInfo, got {type(self.error).__name__}")
        if self.id is None and self.error is None:
            raise InvalidArgument("a successful response needs the request id")
        if self.id is not None and not is_u64(self.id):
            raise InvalidArgument(f"response id must be an int in [0, 2**64 - 1], got {self.id!r}")
        if self.result is not None and RESULT_TYPES.get(self.result.OP) is not type(self.result):
            raise InvalidArgument(f"{type(self.result).__name__} is not a result body")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def op(self) -> str | None:
        return None if self.result is None else self.result.OP

    def unwrap(self) -> Body:
        """The result, or raise the error as its ProtocolError subclass."""
        if self.error is not None:
            raise self.error.exception(self.id)
        assert self.result is not None
        return self.result
