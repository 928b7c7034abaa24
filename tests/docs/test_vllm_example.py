"""The README's vLLM example, run as written: twice on one fresh storage directory."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import REPO
from tests.docs.test_docs import block_env

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make setup)"),
]


def test_the_vllm_example_runs_twice_on_one_storage_directory(tmp_path: Path) -> None:
    command = ".venv/bin/python examples/vllm_tpcache.py --tp 2 --storage-dir /tmp/tpcache-kv"  # the docs' command
    argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))  # only the storage directory is replaced
    for attempt in ("first", "second"):
        run = subprocess.run(argv, cwd=REPO, env=block_env(tmp_path), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{attempt} run: exit {run.returncode}\n{run.stderr[-4000:]}"
        assert "cached tokens" in run.stdout, run.stdout
