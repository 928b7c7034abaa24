"""The hit rule of a hybrid model against a separately written reference: try every boundary from
the longest down and take the first at which every condition of the rule holds."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tpcache.core.hitrule import QueryPlan, hit_length, keeps_state, window_range


def reference(full: int, window: int, swa: list[bool] | None, state: list[bool] | None) -> int:
    for p in range(full, 0, -1):
        first = max(0, p - window)
        swa_holds = not window or swa is None or all(swa[first:p])
        state_holds = state is None or state[p - 1]
        if swa_holds and state_holds:
            return p
    return 0


cases = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.integers(0, n),
        st.integers(0, 9),
        st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)),
        st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)),
    )
)


@settings(max_examples=800, deadline=None)
@given(cases)
def test_hit_length_is_the_longest_boundary_the_rule_allows(case):
    full, window, swa, state = case
    assert hit_length(full, window, swa, state) == reference(full, window, swa, state)


@settings(max_examples=200, deadline=None)
@given(cases)
def test_the_hit_satisfies_every_condition_and_never_exceeds_the_full_run(case):
    full, window, swa, state = case
    p = hit_length(full, window, swa, state)
    assert 0 <= p <= full
    if p:
        assert window == 0 or swa is None or all(swa[i] for i in window_range(p, window))
        assert state is None or state[p - 1]


def test_fixed_point_examples():
    # a missing SWA page in the window cuts the hit below it; the state then cuts it further
    swa = [True, True, True, False, True, True, True, True]
    state = [True, False, True, False, False, True, False, True]
    assert hit_length(8, 2, swa, None) == 8
    assert hit_length(8, 5, swa, None) == 3  # pages 3..7 include the hole at 3: the boundary goes below it
    assert hit_length(8, 5, swa, state) == 3
    assert hit_length(8, 0, None, state) == 8
    assert hit_length(7, 0, None, state) == 6
    assert hit_length(5, 2, swa, state) == 3  # no state at pages 5 and 4: the boundary falls to 3
    assert hit_length(0, 3, [], []) == 0


def test_states_are_kept_every_k_pages_or_at_the_end():
    assert [i for i in range(8) if keeps_state(3, i, 7)] == [2, 5]
    assert [i for i in range(8) if keeps_state(1, i, 7)] == list(range(8))
    assert [i for i in range(8) if keeps_state(-1, i, 6)] == [6]


def test_a_storage_lookup_answers_with_the_rule_over_what_it_found():
    # pages 0..3 resident, 4.. looked up; window of 3 pages reads back into the resident prefix
    plan = QueryPlan(start=4, window=3, swa_before=(True, False), state=True, state_pages=(True,) * 4)
    # the resident page 3 (0-based) has no SWA: a boundary within 3 pages above it cannot be a hit
    assert plan.answer(4, [True] * 4, [True] * 4) == 4
    assert plan.answer(4, [True] * 4, [True, True, False, False]) == 0  # the hole at 3 reaches boundary 6
    assert plan.answer(2, [True] * 4, [True] * 4) == 0
    full_only = QueryPlan(start=0)
    assert full_only.answer(3, [], []) == 3
