import pytest

from tpcache.core import HostAllocator, OutOfPages, PageAllocator


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
