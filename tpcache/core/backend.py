"""Which tree core this process runs, chosen once when tpcache is first imported.

``native``: the C extension ``tpcache.core.treecore._node`` (tree nodes the garbage collector never walks,
and the hot loops of the core in C), with the row copy ``tpcache.io._rowcopy`` where built.
``reference``: the pure-Python core, the specification the native one is held equal to (the same
decisions and digests, slower, with collection pauses that grow with the cache).

The choice is the setting ``tree_core`` (``--tree-core``), read from the environment variable
``TPCACHE_TREE_CORE`` when this module is imported: every module of the core asks this one
(``backend.NATIVE``) instead of trying its own import. Unset: ``native`` where it was built,
``reference`` where it was not (an install without a C compiler or without the xxHash header).
Asking for ``native`` where it was not built is refused: ``REFUSED`` holds the one line that says
so, and ``require`` raises it (the core's constructor, the launcher's settings check).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV = "TPCACHE_TREE_CORE"
CHOICES = ("native", "reference")


class TreeCoreError(RuntimeError):
    """The tree core asked for cannot run in this process; the message names the setting."""


def _load(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        return None, str(exc)


def _choose(requested: str) -> tuple[str, ModuleType | None, ModuleType | None, str, str | None]:
    """(name, _node, _rowcopy, why, refusal) for the environment's value ``requested``."""
    if requested and requested not in CHOICES:
        refusal = f"{ENV}={requested}: the tree core must be one of {', '.join(CHOICES)}"
        return "reference", None, None, "refused", refusal
    if requested == "reference":
        return "reference", None, None, f"chosen by {ENV}", None
    node, missing = _load("tpcache.core.treecore._node")
    if node is None:
        why = f"the native extension was not built ({missing}); see docs/development.md"
        if requested == "native":
            return "reference", None, None, why, f"{ENV}=native: {why}; use reference"
        return "reference", None, None, why, None
    rowcopy, _ = _load("tpcache.io._rowcopy")
    return "native", node, rowcopy, f"chosen by {ENV}" if requested else "the default where built", None


NAME, NATIVE, ROWCOPY, WHY, REFUSED = _choose(os.environ.get(ENV, "").strip().lower())
BUILT = NATIVE is not None or _load("tpcache.core.treecore._node")[0] is not None
DEFAULT = "native" if BUILT else "reference"
DEFAULT_WHY = "the default where built" if BUILT else WHY
# The shard layout's records gathered and checked in C, under the native core where built; None: Python.
RECORD = _load("tpcache.io._record")[0] if NATIVE is not None else None


def require(value: str | None = None, setting: str = "tree_core") -> None:
    """Raise TreeCoreError (one line naming ``setting``) if this process cannot run the tree core
    ``value`` (None: the one the environment asked for)."""
    if REFUSED is not None:
        raise TreeCoreError(REFUSED)
    if value is None or value == NAME:
        return
    if value not in CHOICES:
        raise TreeCoreError(f"{setting} = {value}: must be one of {', '.join(CHOICES)}")
    if value == "native" and not BUILT:
        raise TreeCoreError(f"{setting} = native: the native extension was not built here; use reference")
    raise TreeCoreError(
        f"{setting} = {value}: this process runs the {NAME} tree core, chosen when tpcache was imported; "
        f"set {ENV}={value} in its environment"
    )


def describe() -> str:
    """The tree core for a start-up line: its name and why."""
    return f"{NAME} ({WHY})"
