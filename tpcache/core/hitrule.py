"""The hit rule of a hybrid model, as one pure function.

A hit of ``P`` pages lets the engine skip computing the first ``P`` pages of a request. With full
attention only, that needs the full pages 1..P. A sliding-window layer reads, for the tokens after
the boundary, the keys of the last ``W`` tokens before it: the SWA pages covering them (the last
``ceil(W / page_size)`` pages before the boundary, fewer near the start) must be valid. A recurrent
(Mamba) layer continues from its state at the boundary: a state at page ``P`` must be valid.

``hit_length`` gives the longest such ``P``: it starts at the longest run of valid full pages and,
whenever a condition fails, tries the longest shorter ``P`` that could satisfy it, until all hold (a
fixed point; ``P = 0`` always holds). Each page is looked at once, so the cost is linear in the path.

The same function decides what ``lock`` pins, what ``load`` brings back per component, and what a
storage prefetch may count as a hit (``QueryPlan``), on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def hit_length(
    full: int,
    window: int = 0,
    swa_ok: Sequence[bool] | None = None,
    state_ok: Sequence[bool] | None = None,
) -> int:
    """The longest ``P <= full`` with ``swa_ok[j]`` for every ``j`` in ``[P - window, P)`` (clipped at
    0; only when ``window`` > 0) and ``state_ok[P - 1]`` (only when ``state_ok`` is given). Indexes
    are 0-based pages; ``full`` is the count of leading pages whose full-attention data is valid."""
    p = full
    ok_from = p  # swa_ok holds for every j in [ok_from, p)
    while p > 0:
        if state_ok is not None and not state_ok[p - 1]:
            p -= 1
            continue
        if window and swa_ok is not None:
            need = max(0, p - window)
            ok_from = min(ok_from, p)
            while ok_from > need and swa_ok[ok_from - 1]:
                ok_from -= 1
            if ok_from > need:  # page ok_from - 1 is missing: every boundary above it reads it
                p = ok_from - 1
                ok_from = p
                continue
        return p
    return 0


def window_range(p: int, window: int) -> range:
    """The 0-based pages whose SWA data a hit of ``p`` pages reads."""
    return range(max(0, p - window), p)


def keeps_state(spec_every: int, index: int, last: int) -> bool:
    """Whether a recurrent state is kept at 0-based page ``index`` of an insert whose last page is
    ``last``: at every k-th page boundary (``spec_every`` = k), or only at the insert's end (-1)."""
    if spec_every > 0:
        return (index + 1) % spec_every == 0
    return index == last


@dataclass(frozen=True)
class QueryPlan:
    """What a storage lookup of a hybrid model needs to compute this rank's hit with ``hit_length``.

    The lookup asks for pages ``start, start + 1, ...`` of the path; ``swa_before`` says which of the
    pages just before ``start`` (the resident prefix, up to one window) have readable SWA data. For
    each looked-up page the I/O layer checks the full page's key, the SWA key (``window`` > 0) and
    the state's key (``state``: at the pages where a state may be kept, ``state_pages``); the rank's
    answer is the hit past ``start`` that ``hit_length`` allows over those facts."""

    start: int
    window: int = 0
    swa_before: tuple[bool, ...] = ()
    state: bool = False
    state_pages: tuple[bool, ...] = ()  # per looked-up page: a state may be kept there

    def answer(self, full: int, swa: Sequence[bool], states: Sequence[bool]) -> int:
        """This rank's hit in looked-up pages: ``full`` leading full pages present, then per page
        whether its SWA key and its state key are present."""
        before = len(self.swa_before)
        swa_ok = list(self.swa_before) + list(swa) if self.window else None
        state_ok = [False] * before + list(states) if self.state else None
        return max(0, hit_length(before + full, self.window, swa_ok, state_ok) - before)
