"""The README's vLLM example, run as a user runs it: ``examples/vllm_tpcache.py --tp 2 --storage-dir
D`` with its defaults (the host tier sized from free memory), twice on one fresh storage directory.

Only hits tpcache alone could have served count: vLLM caches a block as soon as it schedules it,
so in a batch of prompts that share a prefix, prompts 2-4 may hit vLLM's own cache. The first
prompt after ``reset_prefix_cache`` (first run) can only hit tpcache's host tier, and the first
prompt of the second run's first batch only its storage tier (a fresh vLLM, a fresh host tier).
Runs in the TP=2 ring's xdist group, so that it never runs engines beside the ring's.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.harness import REPO, repo_env
from tests.vllm.conftest import TP2_GROUP

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900), pytest.mark.xdist_group(TP2_GROUP)]

BATCH = re.compile(
    r"^(?P<batch>first batch|after reset_prefix_cache): cached tokens per prompt \[(?P<prompts>[\d, ]+)\]; "
    r"by source: vLLM prefix cache (?P<vllm>\d+), tpcache host (?P<host>\d+), tpcache storage (?P<storage>\d+)$",
    re.M,
)
STARTUP = re.compile(
    r"\(Worker_TP(\d)[^)]*\) INFO .*tpcache \S+ rank (\d) of 2: host tier (\d+) pages of .*"
    r"a tenth of the least memory available on any rank, .*; available: rank 0 .*, rank 1 .*\); storage "
)


def run_example(tmp: Path, command: str) -> dict[str, dict]:
    """The example's printed batches, after checking that both workers said what they built. ``command``
    is the docs' command as written; it runs through this interpreter, its /tmp/ under ``tmp``."""
    argv = [sys.executable, *shlex.split(command.replace("/tmp/", f"{tmp}/"))[1:]]
    run = subprocess.run(argv, cwd=REPO, env=repo_env(TMPDIR=str(tmp)), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout + run.stderr
    startup = {(int(w), int(r)): int(pages) for w, r, pages in STARTUP.findall(out)}
    # each worker's line, through vLLM's handler: the host tier from free memory, every rank's reading
    assert set(startup) == {(0, 0), (1, 1)}, out[-4000:]
    assert len(set(startup.values())) == 1, startup  # one agreed host tier
    assert "cache closed" not in out, out[-4000:]
    assert "same tokens both times: True" in run.stdout, run.stdout
    batches = {}
    for m in BATCH.finditer(run.stdout):
        prompts = [int(x) for x in m["prompts"].split(",")]
        batches[m["batch"]] = {"prompts": prompts, **{k: int(m[k]) for k in ("vllm", "host", "storage")}}
    assert set(batches) == {"first batch", "after reset_prefix_cache"}, run.stdout
    return batches


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh TMPDIR with a short path, the same for both runs (the example keeps its model there, and
    a page belongs to one model): vLLM binds its engine's ipc sockets in TMPDIR, and a socket path has at
    most 107 bytes, which pytest's directories under xdist run past."""
    with tempfile.TemporaryDirectory(prefix="tpc-", dir="/tmp") as short:
        yield Path(short)


def test_the_readme_vllm_example_hits_tpcache_host_then_storage(short_tmp: Path) -> None:
    tmp_path = short_tmp
    command = ".venv/bin/python examples/vllm_tpcache.py --tp 2 --storage-dir /tmp/tpcache-kv"  # as the docs show it
    first = run_example(tmp_path, command)
    assert first["first batch"]["prompts"][0] == 0  # nothing is cached anywhere yet
    assert first["first batch"]["host"] == first["first batch"]["storage"] == 0
    again = first["after reset_prefix_cache"]
    assert again["prompts"][0] >= 256  # the shared prefix, which only tpcache still held
    assert again["host"] >= again["prompts"][0] and again["storage"] == 0, again

    second = run_example(tmp_path, command)  # a fresh vLLM and tpcache over the same storage
    fresh = second["first batch"]
    assert fresh["prompts"][0] >= 256  # only tpcache's storage tier held it
    assert fresh["storage"] >= fresh["prompts"][0], fresh
