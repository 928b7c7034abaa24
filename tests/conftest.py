from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpcache.testing import netns

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    # Mooncake's transfer engine listens on every interface; in a private network namespace that
    # is loopback only. Rank processes and servers started later inherit it. Without root this
    # does nothing, and the Mooncake tests fail saying why. TPCACHE_TEST_NETWORK=host opts out.
    if os.environ.get("TPCACHE_TEST_NETWORK", "private") == "private":
        netns.isolate()


GROUP_LOST = pytest.StashKey[str]()
ROOT_FIXTURES = ("tmpfs",)  # a test using one of these is a needs_root test


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # On an xdist worker under --dist loadgroup, xdist has by now suffixed each grouped test's id
    # with "@group"; the scheduler groups by that suffix alone. Where it is missing (pytest-xdist
    # 3.8 on pytest 9.2: pytest-dev/pytest-xdist#1386) the groups are spread over both workers and
    # each worker would run the whole vLLM ring: those tests fail at once instead (see below).
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in ROOT_FIXTURES):
            item.add_marker(pytest.mark.needs_root)
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[GROUP_LOST] = (
                "pytest-xdist's --dist loadgroup does not group tests on this pytest (the test's id has "
                "no @group suffix), so the tests of this group would run on every worker: install the "
                "pytest that pyproject.toml's test extra allows (make setup)"
            )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if GROUP_LOST in item.stash:  # before its fixtures start anything
        pytest.fail(item.stash[GROUP_LOST], pytrace=False)


@pytest.fixture
def trace_path() -> Path:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE}")
    return TRACE


SKIPPED_AS_ROOT: list[str] = []  # needs_root tests that skipped although the run is root's


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Tests of faults only root can cause (a full filesystem, a private network) must run in CI,
    # which runs as root: a skip there fails the run (``pytest_sessionfinish``).
    if report.skipped and "needs_root" in report.keywords and os.geteuid() == 0:
        why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else ""
        SKIPPED_AS_ROOT.append(f"{report.nodeid}: {why}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller sees every report
    if SKIPPED_AS_ROOT:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(SKIPPED_AS_ROOT)} needs_root test(s) skipped while running as root:"]
        lines += [f"  {line}" for line in SKIPPED_AS_ROOT]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of this test's own (a small filesystem to fill up); needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    path = tmp_path / "tmpfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
