import random

import pytest

from tpcache.core import HostAllocator, OutOfPages, PageAllocator
from tpcache.core.treecore import allocator


def test_pages_handed_out_in_order_and_reused_lifo():
    a = PageAllocator(4)
    assert a.alloc(2) == [0, 1]
    a.free([0])
    assert a.alloc(2) == [0, 2]
    assert a.available == 1 and a.used == 3
    a.check()


def test_out_of_pages_and_double_free_are_refused():
    a = PageAllocator(2)
    pages = a.alloc(2)
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.free(pages)
    with pytest.raises(ValueError, match="freed but not allocated"):
        a.free([0])
    with pytest.raises(ValueError):
        a.free([7])


def test_same_calls_give_same_pages():
    def run() -> list[int]:
        a = PageAllocator(256)
        out = []
        for i in range(50):
            got = a.alloc(i % 5 + 1)
            out += got
            if i % 3 == 0:
                a.free(got[:1])
        return out

    assert run() == run()


def test_host_free_is_lazy_and_never_hands_a_slot_out_twice():
    h = HostAllocator(4)
    slots = h.alloc(4)
    h.free(slots[:2])
    assert h.available == 2  # released slots count as available...
    assert h.merges == 0  # ...but were not merged yet
    got = h.alloc(2)
    assert h.merges == 1
    assert sorted(got) == sorted(slots[:2])
    with pytest.raises(OutOfPages):
        h.alloc(1)
    h.check()


def test_host_merge_only_when_free_list_is_short():
    h = HostAllocator(8)
    s = h.alloc(2)
    h.free(s)
    h.alloc(3)  # 6 never-used slots suffice: no merge
    assert h.merges == 0
    h.check()


@pytest.mark.skipif(allocator._native is None, reason="tpcache.core.treecore._node was not built (no C compiler)")
@pytest.mark.parametrize("seed", range(4))
def test_native_take_is_the_reference_take(seed):
    """The same random allocs and frees through ``take_pages`` (C) and ``reference_take``: the same
    pages, free lists, ownership marks and never-used mark after every call, None alike."""
    rng = random.Random(seed)
    size = rng.choice([0, 1, 7, 64])
    pools = [([], bytearray(), 0), ([], bytearray(), 0)]
    owned: list[int] = []
    for _ in range(400):
        if owned and rng.random() < 0.4:  # free some pages, as PageAllocator.free does
            for p in rng.sample(owned, rng.randint(1, len(owned))):
                owned.remove(p)
                for free, marks, _fresh in pools:
                    marks[p] = 0
                    free.append(p)
            continue
        n = rng.choice([0, 1, 2, 3, size, size + 1])
        got = []
        for i, take in enumerate((allocator._native.take_pages, allocator.reference_take)):
            free, marks, fresh = pools[i]
            taken = take(free, marks, fresh, size, n)
            got.append(taken)
            if taken is not None:
                pools[i] = (free, marks, taken[1])
        assert got[0] == got[1] and pools[0] == pools[1]
        if got[0] is not None:
            owned += got[0][0]
    assert sorted(owned) == [p for p, mark in enumerate(pools[0][1]) if mark]


@pytest.mark.skipif(allocator._native is None, reason="tpcache.core.treecore._node was not built (no C compiler)")
def test_native_take_refuses_a_pool_it_cannot_read_and_changes_nothing():
    take = allocator._native.take_pages
    with pytest.raises(TypeError):
        take((1,), bytearray(2), 2, 4, 1)
    with pytest.raises(ValueError, match="take_pages"):
        take([], bytearray(1), 2, 4, 1)  # the marks must cover exactly the pages below ``fresh``
    free, marks = [0, 9], bytearray(2)
    with pytest.raises(ValueError, match="out of range"):
        take(free, marks, 2, 4, 2)  # page 9 was never handed out
    assert (free, marks) == ([0, 9], bytearray(2))
    assert take([], bytearray(), 0, 3, 4) is None

    class Index:  # an index-like count (a numpy integer, say), which the reference takes too
        def __init__(self, n: int) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n

    assert take([], bytearray(), Index(0), Index(4), Index(2)) == ([0, 1], 2)
