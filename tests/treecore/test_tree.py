"""The page walk with run caches gives exactly what a page-by-page walk gives, under any mutations;
runs are built for small pages only."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpcache.core.hashing import as_token_bytes, hash_chain
from tpcache.core.treecore.tree import RUN_PAGE_BYTES, RadixTree

PAGE = 2


def reference_walk(tree: RadixTree, token_bytes: bytes) -> list[int]:
    step, node, out = PAGE * 4, tree.root, []
    for start in range(0, len(token_bytes) - step + 1, step):
        node = node.children.get(token_bytes[start : start + step])
        if node is None:
            break
        out.append(node.node_id)
    return out


def path_tokens(path: tuple[int, ...], tail: int = 0) -> bytes:
    return as_token_bytes([v for v in path for _ in range(PAGE)] + [9] * tail)


def add_path(tree: RadixTree, path: tuple[int, ...]) -> None:
    token_bytes = path_tokens(path)
    walk = tree.walk(token_bytes)
    parent = walk.nodes[-1] if walk.nodes else tree.root
    hashes = walk.hashes
    for i in range(len(walk.nodes), walk.num_pages):
        parent = tree.add_child(parent, walk.pages[i], hashes[i], 0)


def remove_leaves(tree: RadixTree, pick: int) -> None:
    leaves = [n for n in tree.nodes.values() if n.parent is not None and not n.children]
    if leaves:
        tree.remove_leaf(leaves[pick % len(leaves)])


paths = st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), paths),
        st.tuples(st.just("rm"), st.integers(0, 50)),
        st.tuples(st.just("walk"), paths, st.integers(0, PAGE - 1)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_run_cached_walk_equals_page_by_page_walk(stream):
    tree = RadixTree(PAGE)
    for op in stream:
        if op[0] == "add":
            add_path(tree, op[1])
        elif op[0] == "rm":
            remove_leaves(tree, op[1])
        else:
            token_bytes = path_tokens(op[1], op[2])
            walk = tree.walk(token_bytes)
            assert [n.node_id for n in walk.nodes] == reference_walk(tree, token_bytes)
            assert walk.num_pages == len(op[1])
            assert walk.hashes == hash_chain(token_bytes, PAGE, "")
            assert walk.pages == [token_bytes[i * PAGE * 4 : (i + 1) * PAGE * 4] for i in range(len(op[1]))]


def test_a_branch_inside_a_cached_run_is_found():
    tree = RadixTree(PAGE)
    add_path(tree, (1, 1, 1, 1))
    assert len(tree.walk(path_tokens((1, 1, 1, 1))).nodes) == 4  # builds the run
    add_path(tree, (1, 1, 2))  # a second child in the middle of the run
    assert len(tree.walk(path_tokens((1, 1, 2))).nodes) == 3
    assert len(tree.walk(path_tokens((1, 1, 1, 1))).nodes) == 4


def test_a_chain_is_the_children_added_one_below_the_other():
    """``add_chain`` makes the nodes (ids, parents, children, runs) that ``add_child`` in turn makes."""
    pages = [path_tokens((v,)) for v in (1, 2, 3, 4)]
    trees = RadixTree(PAGE), RadixTree(PAGE)
    for tree in trees:  # a branch point, so the first new child invalidates a cached run
        add_path(tree, (7, 8))
        tree.walk(path_tokens((7, 8)))
    a, b = trees
    chain = a.add_chain(a.root, pages, [11, 12, 13, 14], 5)
    parent = b.root
    for page, h in zip(pages, [11, 12, 13, 14], strict=True):
        parent = b.add_child(parent, page, h, 5)
    assert [n.node_id for n in chain] == [n.node_id for n in parent.path()]
    for x, y in zip(chain, parent.path(), strict=True):
        assert (x.tokens, x.hash, x.depth, x.last_access, x.parent.node_id) == (
            y.tokens,
            y.hash,
            y.depth,
            y.last_access,
            y.parent.node_id,
        )
    assert reference_walk(a, b"".join(pages)) == reference_walk(b, b"".join(pages))
    assert a.walk(b"".join(pages)).nodes[-1].node_id == chain[-1].node_id
    assert len(a) == len(b) == 6


def _name(named: dict, run) -> object:
    if run is None:
        return None
    return named.setdefault(id(run), (len(named), tuple(n.node_id for n in run.nodes)))


def test_run_marks_and_page_copies_in_c_equal_the_reference_loops(monkeypatch):
    """``mark_run`` and ``run_pages`` (``_chain.c``) leave the marks, the page caches and the pages
    the Python loops of ``runs`` leave, a page cached by another run included."""
    from tpcache.core.treecore import runs

    if runs._mark_run is None:
        pytest.skip("the native extension is not built")
    seen = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(runs, "_mark_run", None)
            monkeypatch.setattr(runs, "_run_pages", None)
        tree = RadixTree(PAGE)
        for path in ((1, 2, 0, 1, 2, 0), (1, 2, 2), (0, 1, 1, 1)):
            add_path(tree, path)
        for node in tree.nodes.values():
            node.device_page = 3 * node.node_id + 1
        by_id = tree.nodes
        first, _ = tree._run(by_id[3])  # nodes 4, 5, 6 (node 2 branches to 3 and 7)
        lower, _ = tree._run(by_id[8])  # nodes 9, 10, 11
        pages = [list(first.device_pages()), list(lower.device_pages())]
        again, _ = tree._run(by_id[4])  # nodes 5 and 6, whose pages ``first`` caches
        pages.append(list(again.device_pages()))
        named: dict[int, object] = {}  # each run by its order of first sight, and its nodes
        marks = {i: (_name(named, n.run), n.run_at, _name(named, n.pages_run)) for i, n in sorted(by_id.items())}
        seen.append((pages, marks, first.pages is None, [len(r.nodes) for r in (first, lower, again)]))
    assert seen[0] == seen[1]
    assert seen[0][2]  # ``again`` took a page ``first`` cached: ``first`` forgot its pages


def test_a_walk_that_diverges_inside_a_run_matches_the_agreeing_pages():
    tree = RadixTree(PAGE)
    path = tuple(i % 3 for i in range(40))
    add_path(tree, path)
    tree.walk(path_tokens(path))  # builds the run
    for cut in (0, 1, 2, 17, 38, 39):
        other = path[:cut] + (7,) + path[cut + 1 :]
        walk = tree.walk(path_tokens(other))
        assert [n.node_id for n in walk.nodes] == reference_walk(tree, path_tokens(other))
        assert len(walk.nodes) == cut
        for node in tree.nodes.values():
            node.device_page = 5 * node.node_id
        assert list(walk.device_page_ids(cut)) == [5 * n.node_id for n in walk.nodes]


def test_a_native_run_is_not_walked_by_the_collector(monkeypatch):
    """A run of native nodes keeps its nodes and ids where a collection untracks them, and the run and
    its page array are untracked too, so a full collection visits neither the cached pages one by one
    nor one object per cached chain; ``mark_run`` and ``run_pages`` still do
    the run's marks and page copies (they answer True and an array, not the reference's fallback)."""
    import gc

    from tpcache.core.treecore import runs

    if runs._mark_run is None:
        pytest.skip("the native extension is not built")
    answers: list[object] = []

    def spy(kernel):
        def call(*args):
            answers.append(kernel(*args))
            return answers[-1]

        return call

    monkeypatch.setattr(runs, "_mark_run", spy(runs._mark_run))
    monkeypatch.setattr(runs, "_run_pages", spy(runs._run_pages))
    tree = RadixTree(PAGE)
    add_path(tree, (1, 2, 0, 1, 2, 0))
    for node in tree.nodes.values():
        node.device_page = 3 * node.node_id + 1
    walk = tree.walk(path_tokens((1, 2, 0, 1, 2, 0)))  # builds the run below the root
    assert list(walk.device_page_ids(6)) == [3 * i + 1 for i in range(1, 7)]
    run = tree.root.run
    assert [n.node_id for n in run.nodes] == list(run.ids) == [1, 2, 3, 4, 5, 6]
    assert answers[0] is True and list(answers[1]) == [3 * i + 1 for i in range(1, 7)]
    gc.collect()
    assert not gc.is_tracked(run.nodes) and not gc.is_tracked(run.ids)
    assert not gc.is_tracked(run) and not gc.is_tracked(run.pages)  # in no cycle the tree does not break


@pytest.mark.parametrize("page_size", [16, 47, 48, 512])
def test_runs_are_built_for_pages_under_48_tokens_only_and_the_walk_is_the_same(page_size):
    tree = RadixTree(page_size)
    pages = [[i % 5 + 1] * page_size for i in range(12)]
    parent = tree.root
    for tokens, page_hash in zip(pages, hash_chain(as_token_bytes(sum(pages, [])), page_size, ""), strict=True):
        parent = tree.add_child(parent, as_token_bytes(tokens), page_hash, 0)
    for node in tree.nodes.values():
        node.device_page = 10 + node.node_id
    whole = tree.walk(as_token_bytes(sum(pages, [])))
    assert [n.node_id for n in whole.nodes] == whole.ids == list(range(1, 13))
    assert list(whole.device_page_ids(12)) == list(range(11, 23))
    assert list(whole.device_page_ids(5)) == list(range(11, 16))
    # a walk that parts from the chain inside it (page 7 differs), then one from the middle
    other = sum(pages[:7], []) + [99] * page_size + sum(pages[8:], [])
    assert [n.node_id for n in tree.walk(as_token_bytes(other)).nodes] == list(range(1, 8))
    below = tree.walk(as_token_bytes(sum(pages[4:], [])), start=tree.nodes[4])
    assert below.ids == list(range(5, 13)) and list(below.device_page_ids(8)) == list(range(15, 23))
    built = [n.node_id for n in tree.nodes.values() if n.run is not None]
    assert (built != []) == (page_size * 4 < RUN_PAGE_BYTES), built
