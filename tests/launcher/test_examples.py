"""The docs' example blocks are the files in examples/, and those files run as written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.local import free_port
from tests.service.harness import REPO, repo_env, running_service

MARKER = re.compile(r"<!-- doc: tested-by (examples/\S+\.py) [^>]*-->\n```python\n(.*?)```\n", re.S)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def run_in_repo(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=timeout)


def torchrun(command: str) -> subprocess.CompletedProcess[str]:
    """A documented ``torchrun`` command as written, through this interpreter, on a free master port."""
    argv = shlex.split(command)
    assert argv[0].endswith("torchrun"), argv
    return run_in_repo(sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *argv[1:])


def example_body(path: Path) -> str:
    """The file from its first import on (the docs leave out the module docstring)."""
    lines = path.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    return "".join(lines[first:])


def test_the_docs_show_the_example_files_exactly() -> None:
    """Each of these files is shown whole in the docs (other examples appear as excerpts, which
    tests/docs/test_docs.py finds in their files)."""
    whole = {"examples/embedding.py", "examples/hybrid.py", "examples/client.py"}
    blocks = [(page, path, block) for page in DOCS for path, block in MARKER.findall(page.read_text()) if path in whole]
    assert {path for _, path, _ in blocks} == whole
    for page, path, block in blocks:
        assert block == example_body(REPO / path), f"{page.relative_to(REPO)}'s block for {path} differs from the file"


@pytest.mark.multiprocess
def test_the_embedding_example_runs_under_torchrun() -> None:
    run = torchrun(".venv/bin/torchrun --nproc-per-node 2 examples/embedding.py")
    assert run.returncode == 0, run.stderr[-4000:]
    for rank in (0, 1):  # the second turn hits every full page, on every rank
        assert f"rank {rank} turn 0: 0 of 62 pages hit" in run.stdout, run.stdout
        assert f"rank {rank} turn 1: 62 of 62 pages hit" in run.stdout, run.stdout


@pytest.mark.multiprocess
def test_the_hybrid_example_runs_under_torchrun() -> None:
    run = torchrun(".venv/bin/torchrun --nproc-per-node 2 examples/hybrid.py")
    assert run.returncode == 0, run.stderr[-4000:]
    for rank in (0, 1):  # the second turn hits up to the last state (page 60), with its SWA window
        assert f"rank {rank} turn 0: 0 of 62 pages hit" in run.stdout, run.stdout
        assert f"rank {rank} turn 1: 60 of 62 pages hit" in run.stdout, run.stdout


@pytest.mark.multiprocess
def test_the_client_example_runs_against_a_service(tmp_path: Path) -> None:
    with running_service(tmp_path) as service:
        run = run_in_repo(sys.executable, "examples/client.py", service.endpoint, timeout=60)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.splitlines()[:2] == ["turn 0: 0 of 1000 tokens hit", "turn 1: 992 of 1000 tokens hit"]
    assert "state='open'" in run.stdout and "equal digests: True" in run.stdout
