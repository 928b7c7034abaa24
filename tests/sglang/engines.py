"""Running one SGLang engine of a test: ``driver.py`` in a child process of its own session, with the
test-only shims and this checkout ahead on ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tpcache.testing.child import run_in_own_session

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
SHIMS = Path(__file__).with_name("shims")
ENGINE_TIMEOUT_S = 420


def plugin_dist(directory: Path) -> Path:
    """A directory to put on ``PYTHONPATH`` holding a ``tpcache`` dist-info with pyproject.toml's entry
    points: SGLang then finds tpcache's plugin even where the installed tpcache predates it."""
    import tomllib  # Python 3.11 on (SGLang's venv)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = project["entry-points"]["sglang.srt.plugins"]
    dist = directory / "dist" / f"tpcache-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tpcache\nVersion: {project['version']}\n")
    lines = "".join(f"{name} = {value}\n" for name, value in points.items())
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{lines}")
    return dist.parent


def run_engine(
    workdir: Path,
    name: str,
    spec: dict,
    *,
    path: Sequence[Path] = (),
    env: Mapping[str, str] | None = None,
    ends_in_error: bool = False,
) -> dict:
    """Run the driver on ``spec`` and return what it wrote; ``path`` goes ahead of the shims on
    ``PYTHONPATH`` and ``env`` over the environment. A failed engine fails the test with its log's end;
    with ``ends_in_error`` the engine must instead exit by itself with an error (not time out), and
    its exit code comes back as ``exit_code``."""
    spec_file, out_file, log_file = workdir / f"{name}.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    python_path = [*map(str, path), str(SHIMS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path), **(env or {})}
    # Its own session: a timeout takes the engine's scheduler processes too.
    code = run_in_own_session(
        [sys.executable, str(DRIVER), str(spec_file), str(out_file)], log_file, full_env, ENGINE_TIMEOUT_S, workdir
    )
    if ends_in_error and isinstance(code, int) and code != 0 and out_file.exists():
        return {**json.loads(out_file.read_text()), "exit_code": code}
    if ends_in_error or code != 0 or not out_file.exists():
        tail = log_file.read_bytes()[-6000:].decode(errors="replace")
        what = "did not end in an error of its own" if ends_in_error and code == 0 else "failed"
        raise AssertionError(f"the SGLang engine {name!r} {what} ({code}); the end of its log:\n{tail}")
    return json.loads(out_file.read_text())
