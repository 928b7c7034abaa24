"""The conformance suite runs against both tree cores in one pytest run: this process runs one
(``tpcache.core.backend`` chose it at import), and this test runs the rest of ``tests/treecore`` in a
child process under the other, where it is built. The native-only files there compare C kernels with
their Python references and skip under ``reference``."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tpcache.core import backend

OTHER = "reference" if backend.NAME == "native" else "native"


@pytest.mark.skipif(os.environ.get("TPCACHE_TREECORE_CHILD") == "1", reason="the child run itself")
@pytest.mark.skipif(OTHER == "native" and not backend.BUILT, reason="the native tree core is not built here")
def test_the_suite_passes_on_the_other_backend():
    env = {**os.environ, backend.ENV: OTHER, "TPCACHE_TREECORE_CHILD": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/treecore"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, f"tests/treecore under {backend.ENV}={OTHER}:\n{tail}"
    assert " passed" in tail, tail
