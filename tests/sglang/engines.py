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


def run_engine(
    workdir: Path, name: str, spec: dict, *, path: Sequence[Path] = (), env: Mapping[str, str] | None = None
) -> dict:
    """Run the driver on ``spec`` and return what it wrote; ``path`` goes ahead of the shims on
    ``PYTHONPATH`` and ``env`` over the environment. A failed engine fails the test with its log's end."""
    spec_file, out_file, log_file = workdir / f"{name}.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    python_path = [*map(str, path), str(SHIMS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path), **(env or {})}
    # Its own session: a timeout takes the engine's scheduler processes too.
    code = run_in_own_session(
        [sys.executable, str(DRIVER), str(spec_file), str(out_file)], log_file, full_env, ENGINE_TIMEOUT_S, workdir
    )
    if code != 0 or not out_file.exists():
        tail = log_file.read_bytes()[-6000:].decode(errors="replace")
        raise AssertionError(f"the SGLang engine {name!r} failed ({code}); the end of its log:\n{tail}")
    return json.loads(out_file.read_text())
