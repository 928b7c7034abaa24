"""Typed errors of the io shell (pools and transfers).

Every error a caller can provoke with bad input is one of these, with a message that names the
offending value, so a healthy rank never crashes on an unexpected exception type.
"""

from __future__ import annotations


class KVLayoutError(ValueError):
    """A KV layout, pool shape or external tensor does not describe valid paged KV."""


class PageIndexError(ValueError):
    """A page or slot list is malformed: out of range, duplicated, wrong type or mismatched length."""


class TransferError(RuntimeError):
    """A transfer op failed (its completion carries ok=False) or the engine refused it."""


class EngineClosedError(TransferError):
    """The transfer engine was closed; no new op is accepted."""


class OpIdError(ValueError):
    """An op id is not a new, strictly increasing integer, or names an op that was never submitted."""


class TransferTimeoutError(TimeoutError):
    """Waiting for an op or a layer did not finish within the given timeout."""
