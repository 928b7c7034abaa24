"""A local Mooncake Store in one command: ``python -m tpcache.testing.servers mooncake -- COMMAND``
starts the metadata server, the master and a segment holder, runs COMMAND beside them with
TPCACHE_STORAGE_URL set, and stops them when it exits, with its exit code."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.service.harness import REPO, repo_env

ROUND_TRIP = """
import os, sys
from tpcache.io.storage import StorageKey, open_storage
store = open_storage(os.environ["TPCACHE_STORAGE_URL"] + "&direct_put=0&direct_get=0", shard=(0, 1))
keys, page = [StorageKey("one-command", 1, 0, 1, 7)], bytes(range(256)) * 16
assert store.put(keys, [page]) == [True]
out = [bytearray(len(page))]
assert store.get(keys, out) == [True] and bytes(out[0]) == page
store.close()
print("round trip through", os.environ["TPCACHE_STORAGE_URL"])
sys.exit(3)
"""


def test_a_store_and_a_command_in_one_command() -> None:
    """The command's exit code comes back; with --shared-network one warning names the ports the
    store opened on every interface (the suite runs in a private namespace, so nothing leaks)."""
    argv = [sys.executable, "-m", "tpcache.testing.servers", "mooncake", "--bytes", "64MiB", "--shared-network"]
    done = subprocess.run(
        [*argv, "--", sys.executable, "-c", ROUND_TRIP],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    url = re.fullmatch(r"round trip through (mooncake://127\.0\.0\.1:\d+\?metadata=\S+)\n", done.stdout)
    assert url is not None, done.stdout
    ours = [line for line in done.stderr.splitlines() if line.startswith("tpcache:")]  # the rest is Mooncake's
    assert len(ours) == 2, done.stderr
    assert re.match(
        r"tpcache: warning: --shared-network: the Mooncake Store listens on every interface on port\(s\) \d+", ours[0]
    ), done.stderr
    assert ours[1] == f"tpcache: Mooncake Store ready: TPCACHE_STORAGE_URL={url.group(1)}", done.stderr
