"""Per-page tier states and the transitions between them.

A copy on a tier is readable only in its final state (device/host ``VALID``, storage ``DURABLE``);
the in-flight states exist so that a page being written is never read, evicted or freed.
"""

from __future__ import annotations

from enum import IntEnum


class DeviceState(IntEnum):
    NONE = 0
    LOADING = 1  # a host-to-device load into the page is in flight
    VALID = 2


class HostState(IntEnum):
    NONE = 0
    WRITING = 1  # a copy into the slot (from device or from storage) is in flight
    VALID = 2


class StorageState(IntEnum):
    NONE = 0
    WRITING = 1  # a storage write is in flight; not yet acked by every rank
    DURABLE = 2


class IllegalTransition(RuntimeError):
    """A tier state change the state machine does not allow: a bug, never user input."""


_ALLOWED: dict[type[IntEnum], set[tuple[int, int]]] = {
    DeviceState: {
        (DeviceState.NONE, DeviceState.VALID),  # the engine wrote the KV and inserted it
        (DeviceState.NONE, DeviceState.LOADING),  # load-back from host started
        (DeviceState.LOADING, DeviceState.VALID),  # load agreed complete on every rank
        (DeviceState.LOADING, DeviceState.NONE),  # load failed or was unwound after completing
        (DeviceState.VALID, DeviceState.NONE),  # evicted
    },
    HostState: {
        (HostState.NONE, HostState.WRITING),
        (HostState.WRITING, HostState.VALID),
        (HostState.WRITING, HostState.NONE),
        (HostState.VALID, HostState.NONE),
    },
    StorageState: {
        (StorageState.NONE, StorageState.WRITING),
        (StorageState.WRITING, StorageState.DURABLE),
        (StorageState.WRITING, StorageState.NONE),
        (StorageState.NONE, StorageState.DURABLE),  # agreed storage hit of an older write
        (StorageState.DURABLE, StorageState.NONE),  # dropped from durable tracking
    },
}


# Per tier (device, host, storage) and old state, a bit per allowed new state: the tables above for
# the ledger's C kernels (``_settle.c``).
TRANSITIONS = bytes(
    sum(1 << new for old_, new in _ALLOWED[kind] if old_ == old)
    for kind in (DeviceState, HostState, StorageState)
    for old in range(3)
)


def check_transition(kind: type[IntEnum], old: int, new: int) -> None:
    if (old, new) not in _ALLOWED[kind]:
        raise IllegalTransition(f"{kind.__name__}: {kind(old).name} -> {kind(new).name} is not allowed")
