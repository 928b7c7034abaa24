"""The C extensions are optional: a build without a C compiler, or without xxHash's header, still
succeeds, and each extension it leaves out says why in one line (setup.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def build(tmp_path, **env: str) -> subprocess.CompletedProcess:
    out = tmp_path / "lib"
    argv = ["setup.py", "-q", "build_ext", "--build-lib", str(out), "--build-temp", str(tmp_path / "tmp")]
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("tpcache: building without")]


def test_without_a_compiler_the_build_succeeds_and_says_why_per_extension(tmp_path):
    done = build(tmp_path, CC=str(tmp_path / "no-cc"))
    assert done.returncode == 0, done.stderr
    assert lines(done) == [
        "tpcache: building without tpcache.io._rowcopy (no working C compiler (unix)); page copies use torch instead",
        "tpcache: building without tpcache.core.treecore._node (no working C compiler (unix)); the reference tree core "
        "runs instead",
        "tpcache: building without tpcache.io._record (no working C compiler (unix)); the shard layout checks its "
        "records in Python instead",
        "tpcache: building without protocol._speedups (no working C compiler (unix)); the codec checks ids in "
        "Python instead",
    ]
    assert not list((tmp_path / "lib").rglob("*.so"))


def test_without_the_xxhash_header_the_tree_core_is_left_out_naming_the_package(tmp_path):
    done = build(tmp_path, CFLAGS="-nostdinc")  # no system headers: xxhash.h is not found (nor stdlib.h)
    assert done.returncode == 0, done.stderr
    first = lines(done)[0]
    assert first.startswith(
        "tpcache: building without tpcache.core.treecore._node (xxhash.h not found: install libxxhash-dev"
    )
    assert "set C_INCLUDE_PATH" in first and first.endswith("the reference tree core runs instead")
