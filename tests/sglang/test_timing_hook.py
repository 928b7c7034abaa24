"""tpcache's SGLang plugin loads the benchmark's timing hook only when ``TPCACHE_SGLANG_TIMING`` is
set: without it SGLang's classes and torch.distributed stay as they are."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed here: the SGLang ring runs in .venv-sglang (make setup-sglang)",
        allow_module_level=True,
    )

from tests.sglang.engines import ROOT, SHIMS

CHECK = """
import os
import torch.distributed as dist
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from tpcache.integrations.sglang.plugin import register
register()
timed = lambda fn: getattr(fn, "__tpcache_timed__", False)
print(timed(UnifiedRadixCache.match_prefix), timed(dist.all_reduce))
"""


def _run(tmp_path: Path, timing: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TPCACHE_SGLANG_TIMING"}
    env["PYTHONPATH"] = os.pathsep.join([str(SHIMS), str(ROOT)])
    if timing is not None:
        env["TPCACHE_SGLANG_TIMING"] = timing
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-2:]


def test_the_timing_hook_is_inert_unless_its_setting_is_set(tmp_path: Path) -> None:
    assert _run(tmp_path, None) == ["False", "False"]
    assert _run(tmp_path, str(tmp_path / "timing")) == ["True", "True"]
