"""The walk's run caches, for pages under 48 tokens (``tree.RUN_PAGE_BYTES``): a chain of
single-child nodes cached as one run of pages (``tree.Run``), so that a lookup compares, and copies
the device pages of, a whole run at once. The per-node marks and page copies are loops in C where
built (``_chain.c``: ``mark_run``, ``run_pages``); the Python loops here are the reference, and
tests hold the two equal."""

from __future__ import annotations

from array import array
from typing import Any

from tpcache.core.backend import NATIVE

Node = Any  # tree.Node (a native node or tree.PyNode); tree imports this module

_mark_run, _run_pages = (NATIVE.mark_run, NATIVE.run_pages) if NATIVE is not None else (None, None)


class Run:
    """A chain of single-child nodes, cached for the walk: their tokens joined (one compare checks
    the whole chain), their ids and, built on first use, their device pages (a walk copies a slice).

    Invariant: while ``pages`` is set, ``pages[i] == nodes[i].device_page`` and ``nodes[i].pages_run
    is self`` for every i; so a node's device page changes only after ``drop_pages`` on its run.

    ``nodes`` and ``ids`` are tuples: holding only native nodes (which the collector does not track)
    and ints, they are untracked (made so by ``chain_below``, else at their first collection), so a
    full collection does not walk the cached pages one by one (lists would be, a page at a time, in
    every run)."""

    __slots__ = ("data", "nodes", "pages", "ids")

    def __init__(self, nodes: tuple[Node, ...], data: bytes, ids: tuple[int, ...]) -> None:
        """``ids``: the nodes' ids, in order (a node's id never changes)."""
        self.data, self.nodes, self.ids = data, nodes, ids
        self.pages: array | None = None

    def device_pages(self) -> array:
        if self.pages is None:
            pages = None if _run_pages is None else _run_pages(self, self.nodes)  # None: not native nodes
            if pages is None:
                for node in self.nodes:
                    other = node.pages_run
                    if other is not None and other is not self:
                        other.pages = None  # a node's page is cached by one run at most
                    node.pages_run = self
                pages = array("i", [node.device_page for node in self.nodes])
            self.pages = pages
        return self.pages


def mark(run: Run, node: Node) -> None:
    """``node.run = run`` at 0, and each node of the run but its last gets it at its own start."""
    if _mark_run is not None and _mark_run(run, node, run.nodes):
        return
    node.run, node.run_at = run, 0
    for i, c in enumerate(run.nodes[:-1]):
        c.run, c.run_at = run, i + 1


def drop_pages(node: Node) -> None:
    """Forget the cached device page of ``node`` (call before changing it)."""
    run = node.pages_run
    if run is not None:
        run.pages = None
        node.pages_run = None


def agreeing(data: bytes, pos: int, run: Run, first: int, count: int, step: int) -> int:
    """How many of the ``count`` pages of ``run`` from its ``first`` agree with ``data`` from byte
    ``pos``, when not all of them do: runs of pages compared at once, growing while they agree
    (most walks part within a few pages), then halving the last run that did not."""
    view: Any = memoryview(run.data)
    offset = first * step
    lo, hi, size = 0, count - 1, 1  # lo pages agree; all count do not
    while lo < hi:
        mid = min(lo + size, hi)
        if data.startswith(view[offset + lo * step : offset + mid * step], pos + lo * step):
            lo, size = mid, 2 * size
        else:
            hi, size = mid - 1, 1
    return lo
