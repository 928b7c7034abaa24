"""Sequenced operations as data: the messages every rank's driver applies to its core, in order.

An ``Op`` is a record, not a callable: a kind (a key of ``APPLY``) and its arguments, plain values
(token ids, lease ids, page numbers, a component's index, a prefill ``Shape``). ``Driver.apply``
looks the kind up in the one dispatch table below and calls the core with the arguments, so the
sequence a rank applied can be logged, compared between ranks and followed from a request into the
core: ``Driver.trace`` sees each op before it is applied, and ``OpLog`` writes them down (the
service does for every rank when ``TPCACHE_TRACE_OPS`` names a folder).

Every rank applies the same ops in the same order and the core is deterministic, so equal
sequences mean equal states; the round's ``seq`` field counts them.

The table's entries name each op's arguments; an op's result is the core's answer (shaping it into a
reply is the caller's business and never enters the sequence).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgpack


class Op(NamedTuple):
    """One sequenced operation: ``kind`` (a key of ``APPLY``) and its arguments, plain values."""

    kind: str
    args: tuple[Any, ...] = ()

    def plain(self) -> list[Any]:
        """The op as lists, ints, bytes and strings (``[kind, [args...]]``): what msgpack encodes."""
        return [self.kind, [plain(a) for a in self.args]]


# kind -> how the driver applies it: fn(driver, *args). The core's sequenced operations, the round's
# feature switch, and nothing else (``register`` adds a test harness's own).
APPLY: dict[str, Callable[..., Any]] = {
    "lock": lambda d, tokens: d.core.lock(tokens),
    "admit": lambda d, tokens, prefetch: d.core.admit(tokens, prefetch),
    "materialize": lambda d, lease, planned: d.core.materialize(lease, planned),
    "commit": lambda d, lease: d.core.commit(lease),
    "alloc": lambda d, lease, pages, part: d.core.alloc(lease, pages, part),
    "insert": lambda d, lease, tokens, pages, parts: d.core.insert(lease, tokens, pages, parts),
    "append": lambda d, lease, tokens, pages, parts: d.core.append(lease, tokens, pages, parts),
    "load": lambda d, lease: d.core.load(lease),
    "prefetch": lambda d, lease, read: d.core.prefetch(lease, read),
    "release": lambda d, lease: d.core.release(lease),
    "save": lambda d, lease, tokens, blocks: d.core.save(lease, tokens, blocks),
    "load_into": lambda d, lease, first_page, blocks: d.core.load_into(lease, first_page, blocks),
    "set_retention_cap": lambda d, tokens: d.core.set_retention_cap(tokens),
    "set_feature": lambda d, name, enabled: d.round.set_feature(name, enabled),
    "request_flush": lambda d: d.core.request_flush(),
    "evict_device": lambda d, pages: d.core.evict_device(pages),
    "adopt": lambda d, lease, tokens, pages: d.core.adopt(lease, tokens, pages),
    "load_adopted": lambda d, lease, pages: d.core.load_adopted(lease, pages),
    "drain_returned": lambda d: d.core.drain_returned(),
}


BUILT_IN = frozenset(APPLY)


def register(kind: str, fn: Callable[..., Any]) -> None:
    """Add an op kind (a test harness's own sequenced op; registering it again replaces it). The
    built-in kinds cannot be replaced."""
    if kind in BUILT_IN:
        raise ValueError(f"sequenced op {kind!r} is built in")
    APPLY[kind] = fn


def plain(value: Any) -> Any:
    """``value`` as msgpack's types: token ids and page lists as lists of ints, byte views as bytes,
    a record (a dataclass such as ``Shape``) as the list of its fields."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, array) or hasattr(value, "tolist"):  # token ids: an array, numpy, a tensor
        return value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    raise TypeError(f"a sequenced op's argument must be plain data, not {type(value).__name__}")


class OpLog:
    """A ``Driver.trace`` that appends each op to a file, msgpack-encoded (``read_ops`` reads it)."""

    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "ab")  # noqa: SIM115 - open for the driver's life, written op by op

    def __call__(self, op: Op) -> None:
        self.file.write(msgpack.packb(op.plain()))
        self.file.flush()  # a rank that is killed leaves every op it applied

    def close(self) -> None:
        self.file.close()


def read_ops(path: str | Path) -> list[list[Any]]:
    """The ops an ``OpLog`` wrote, in order, each ``[kind, [args...]]``."""
    with open(path, "rb") as f:
        return list(msgpack.Unpacker(f, raw=False, strict_map_key=False))
