"""Page allocators whose decisions depend only on the sequence of calls.

Every rank runs the same calls in the same order, so every rank hands out the same page numbers:
that is what lets a page number name the same KV on all TP shards.
"""

from __future__ import annotations

from collections import deque

from tpcache.core.backend import NATIVE as _native


class OutOfPages(RuntimeError):
    """Not enough free pages; the caller evicts or refuses."""


class PageAllocator:
    """Pages ``0 .. num_pages-1``: freed pages are reused LIFO, then never-used pages in order.

    Invariants: owned + free + never-used == num_pages; a page is either free or owned, never both.
    LIFO reuse keeps recently freed (cache-warm) pages in use; never-used pages are handed out
    lazily, so a huge (unbounded) pool costs nothing until it is used.
    """

    def __init__(self, num_pages: int, name: str = "device") -> None:
        if num_pages < 0:
            raise ValueError(f"{name} pool size must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free: list[int] = []
        self._fresh = 0  # pages >= _fresh were never handed out
        self._owned = bytearray()

    @property
    def available(self) -> int:
        return len(self._free) + self.num_pages - self._fresh

    @property
    def used(self) -> int:
        return self.num_pages - self.available

    def alloc(self, n: int) -> list[int]:
        pages = self.try_alloc(n)
        if pages is None:
            raise OutOfPages(f"{self.name} pool: need {n} pages, {self.available} free")
        return pages

    def try_alloc(self, n: int) -> list[int] | None:
        """``alloc``, or None, changing nothing, when fewer than ``n`` pages are available."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        take = _native.take_pages if _native is not None else reference_take  # the same in C (_pool.c)
        taken = take(self._free, self._owned, self._fresh, self.num_pages, n)
        if taken is None:
            return None
        pages, self._fresh = taken
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self.is_owned(p):
                raise ValueError(f"{self.name} pool: page {p} freed but not allocated")
            self._owned[p] = 0
            self._free.append(p)

    def take(self, pages: list[int]) -> None:
        """Mark these particular pages owned (on a fresh allocator: pages a holder keeps across a reset)."""
        for p in pages:
            if not 0 <= p < self.num_pages or self.is_owned(p):
                raise ValueError(f"{self.name} pool: page {p} cannot be taken")
            if p >= self._fresh:
                self._free.extend(range(self._fresh, p))  # the never-used pages below it become free
                self._fresh = p + 1
                self._owned.extend(bytes(self._fresh - len(self._owned)))
            else:
                self._free.remove(p)
            self._owned[p] = 1

    def is_owned(self, page: int) -> bool:
        return 0 <= page < len(self._owned) and bool(self._owned[page])

    def _check_pool(self, pool: list[int]) -> None:
        owned = sum(self._owned)
        if owned + len(pool) + self.num_pages - self._fresh != self.num_pages:
            raise AssertionError(f"{self.name} pool: {owned} owned + {len(pool)} free != {self.num_pages}")
        if len(set(pool)) != len(pool) or any(self.is_owned(p) or p >= self._fresh for p in pool):
            raise AssertionError(f"{self.name} pool: a page is both free and owned, or free twice")

    def check(self) -> None:
        self._check_pool(self._free)


class HostAllocator(PageAllocator):
    """Host slots with a lazily merged free list.

    ``free`` only appends to a release queue, O(1); the queue is merged into the free list only when
    an allocation needs more than the free list holds, so a burst of frees (a big eviction) costs
    no list surgery. Released slots count as available but are never handed out until merged, so a
    slot is never handed out twice. Merging in release order keeps the result a function of the calls.
    """

    def __init__(self, num_pages: int, name: str = "host") -> None:
        super().__init__(num_pages, name)
        self._released: deque[int] = deque()
        self.merges = 0

    @property
    def available(self) -> int:
        return len(self._free) + len(self._released) + self.num_pages - self._fresh

    @property
    def used(self) -> int:
        return self.num_pages - self.available

    def try_alloc(self, n: int) -> list[int] | None:
        if n > len(self._free) + self.num_pages - self._fresh and self._released:
            self._merge()
        return super().try_alloc(n)

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self.is_owned(p):
                raise ValueError(f"{self.name} pool: slot {p} freed but not allocated")
            self._owned[p] = 0
            self._released.append(p)

    def _merge(self) -> None:
        # Append in reverse so the oldest released slot is handed out first.
        self._free[:0] = reversed(self._released)
        self._released.clear()
        self.merges += 1

    def check(self) -> None:
        self._check_pool(self._free + list(self._released))


def reference_take(
    free: list[int], owned: bytearray, fresh: int, num_pages: int, n: int
) -> tuple[list[int], int] | None:
    """``n`` pages of a pool whose never-used pages start at ``fresh``, and where they start after:
    freed pages first, the last freed first (``free`` loses them), then never-used ones in order;
    ``owned`` marks every page given (it covers exactly the pages below ``fresh``). None, changing
    nothing, when fewer than ``n`` pages are available."""
    new = n - len(free)  # never-used pages it takes, once every freed one is
    if new > num_pages - fresh:
        return None
    reuse = len(free) if new > 0 else n
    pages = free[len(free) - reuse :]
    pages.reverse()
    del free[len(free) - reuse :]
    for p in pages:
        owned[p] = 1
    if new > 0:
        owned.extend(b"\x01" * new)
        pages.extend(range(fresh, fresh + new))
        fresh += new
    return pages, fresh


class AdoptedPages(PageAllocator):
    """A device tier whose pages belong to an engine's own allocator (SGLang's KV pool).

    The core never hands a page out here: pages enter when an insert adopts the pages an engine
    wrote (``take``), and leave when eviction or a lease's release frees them. A freed page goes to
    ``returned``, in the order the core freed it, for the engine to take back (``drain``): the same
    order on every rank, since the core's decisions depend only on the sequence of operations.
    ``available`` is 0 (nothing to hand out); ``used`` counts the pages the core holds.
    """

    def __init__(self, num_pages: int, name: str = "device") -> None:
        super().__init__(num_pages, name)
        self._fresh = num_pages  # no never-used pages: every id is the engine's until taken
        self._owned = bytearray(num_pages)

    @property
    def available(self) -> int:
        return 0

    @property
    def used(self) -> int:
        return self._owned.count(1)

    @property
    def returned(self) -> list[int]:
        """Pages freed and not yet drained, oldest first (read-only view: ``drain`` takes them)."""
        return list(self._free)

    def try_alloc(self, n: int) -> list[int] | None:
        raise ValueError("with device_adopt the engine allocates device pages; give them to adopt")

    def take(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or self.is_owned(p):
                raise ValueError(f"{self.name} pool: page {p} cannot be taken")
        if self._free and not set(pages).isdisjoint(self._free):
            raise ValueError(f"{self.name} pool: a page the engine has not taken back yet was given again")
        for p in pages:
            self._owned[p] = 1

    def untake(self, pages: list[int]) -> None:
        """Give pages back without freeing them: the engine still owns them (not ``returned``)."""
        for p in pages:
            if not self.is_owned(p):
                raise ValueError(f"{self.name} pool: page {p} given back but not held")
            self._owned[p] = 0

    def free_all(self, pages: list[int]) -> None:
        """Put pages on ``returned`` that this pool never held (those of a dropped tree after a reset)."""
        self._free.extend(pages)

    def drain(self) -> list[int]:
        """The freed pages, in the order they were freed; the engine owns them again."""
        out = list(self._free)
        self._free.clear()
        return out

    def check(self) -> None:
        free = self._free
        if len(set(free)) != len(free) or any(self.is_owned(p) or not 0 <= p < self.num_pages for p in free):
            raise AssertionError(f"{self.name} pool: a returned page is held, out of range or returned twice")
