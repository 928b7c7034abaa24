"""One switch for the tree core (``tpcache.core.backend``): ``TPCACHE_TREE_CORE`` / ``--tree-core``,
read once when tpcache is imported, asked by every module of the core, refused in one line where it
cannot run, and named in the start-up block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tpcache.core import backend

# Runs in a fresh interpreter: "unbuilt" hides the extensions as an install without a compiler would.
PROBE = textwrap.dedent(
    """
    import json, sys
    class Unbuilt:
        def find_spec(self, name, path=None, target=None):
            if name in ("tpcache.core.treecore._node", "tpcache.io._rowcopy"):
                raise ImportError("No module named " + repr(name))
    if sys.argv[1] == "unbuilt":
        sys.meta_path.insert(0, Unbuilt())
    from tpcache.core import backend, CacheConfig, CacheCore, digest, hashing
    from tpcache.core.treecore import candidates, holdings, lookup, tree
    from tpcache.io import native
    out = {"name": backend.NAME, "why": backend.WHY, "node": tree.Node.__name__, "rowcopy": native.AVAILABLE,
           "token_bytes": hashing._token_bytes is not None, "lookup": lookup._native_lookup is not None,
           "holding": holdings._NativeHolding is not None, "mix": digest._native is not None,
           "candidacy": candidates._native is not None}
    try:
        CacheCore(CacheConfig(page_size=4, device_pages=8))
        out["refused"] = None
    except backend.TreeCoreError as exc:
        out["refused"] = str(exc)
    print(json.dumps(out))
    """
)
LAUNCH = (
    "import sys\n"
    + PROBE.split("from tpcache.core import")[0]
    + ("from launcher.__main__ import main\nsys.exit(main(sys.argv[2:]))\n")
)


def _env(value: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != backend.ENV}
    if value is not None:
        env[backend.ENV] = value
    return env


def probe(value: str | None, built: bool = True) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "built" if built else "unbuilt"],
        cwd=REPO,
        env=_env(value),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


needs_native = pytest.mark.skipif(not backend.BUILT, reason="the native extension was not built (no C compiler)")
PARTS = ("rowcopy", "token_bytes", "lookup", "holding", "mix", "candidacy")


@needs_native
@pytest.mark.parametrize("value", [None, "native", "NATIVE"])
def test_native_is_the_default_where_built_and_every_module_runs_it(value):
    out = probe(value)
    assert (out["name"], out["node"], out["refused"]) == ("native", "Node", None)
    assert all(out[part] for part in PARTS), out
    assert out["why"] == ("the default where built" if value is None else "chosen by TPCACHE_TREE_CORE")


@pytest.mark.parametrize("built", [True, False])
def test_reference_runs_no_native_code_in_any_module(built):
    out = probe("reference", built)
    assert (out["name"], out["node"], out["refused"]) == ("reference", "PyNode", None)
    assert not any(out[part] for part in PARTS), out


def test_without_the_extension_the_default_is_reference_and_says_why():
    out = probe(None, built=False)
    assert (out["name"], out["node"], out["refused"]) == ("reference", "PyNode", None)
    assert out["why"].startswith("the native extension was not built (No module named 'tpcache.core.treecore._node')")


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("native", "TPCACHE_TREE_CORE=native: the native extension was not built"),
        ("fast", "TPCACHE_TREE_CORE=fast: the tree core must be one of native, reference"),
    ],
)
def test_a_core_that_cannot_run_is_refused_in_one_line(value, line):
    out = probe(value, built=False)
    assert out["refused"].startswith(line) and "\n" not in out["refused"]


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["--tree-core", "native"], None, "--tree-core native: the native extension was not built here; use reference"),
        ([], "native", "TPCACHE_TREE_CORE=native: the native extension was not built here; use reference"),
        (["--tree-core", "fast"], None, "--tree-core fast: must be one of native, reference"),
    ],
)
def test_the_launcher_refuses_a_core_it_cannot_run_before_any_rank_starts(argv, env, line):
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, "unbuilt", "local", "--nproc", "2", *argv],
        cwd=REPO,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"tpcache: configuration error: {line}"


@needs_native
def test_the_start_up_block_names_the_core_each_rank_runs_and_both_reach_the_same_digest():
    digests = {}
    for argv, want in (([], "native (the default where built)"), (["--tree-core", "reference"], None)):
        want = want or "reference (set by command line)"
        done = subprocess.run(
            [sys.executable, "-m", "launcher", "demo", "--conversations", "4", "--requests", "12", "--json", *argv],
            cwd=REPO,
            env=_env(None),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stderr.count(f"  tree core: {want}\n") == 2, done.stderr[-3000:]  # one block per rank
        summary = json.loads(done.stdout.splitlines()[-1])
        digests[want] = summary["digests"]
    assert len({json.dumps(d) for d in digests.values()}) == 1, digests
