"""The vLLM ring's scenario: one plan per TP size, run by ``driver.py`` in a subprocess.

Three engines run one after another on a random tiny Llama made for the run:

1. ``ref``: plain vLLM, its own prefix caching off: the tokens every other run must reproduce;
2. ``conn``: vLLM with tpcache (host tier and a storage directory) and fewer KV blocks than the
   multi-turn workload needs: the batch, the batch again after ``reset_prefix_cache``, the
   conversations, then faults armed on one rank at run time;
3. ``fresh``: a new vLLM on the same storage directory, after the last rank's stored copy of one
   page of two prompts was damaged: hits come from storage and stop where a rank has no good copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tpcache.testing.tiny_model import make_tiny_llama

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
VOCAB = 512


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def prompts(seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    prefix = _ids(rng, 3 * BLOCK)
    batch = [prefix + _ids(rng, 20 + 7 * i) for i in range(4)]
    other = [_ids(rng, 2 * BLOCK) + _ids(rng, 10 + i) for i in range(2)]  # fresh prefixes (divergence)
    users = [[_ids(rng, 40 + 9 * t + 3 * c) for t in range(3)] for c in range(4)]
    return {"batch": batch, "other": other, "users": users}


def plan(tp: int, workdir: Path) -> dict[str, Any]:
    p = prompts()
    store = workdir / "store"
    last = tp - 1
    gen = {"op": "generate", "prompts": p["batch"], "max_tokens": 8}
    conversation = {"op": "conversation", "name": "conversation", "users": p["users"], "max_tokens": 16}
    connector = {"host_pages": 512, "storage_dir": str(store)}
    reset = {"op": "reset_prefix_cache"}
    conn_steps: list[dict[str, Any]] = [
        {**gen, "name": "batch"},
        reset,
        {**gen, "name": "batch_again"},
        {"op": "stats", "name": "stats_batch"},
        conversation,
        {"op": "settle", "name": "settled_conversation"},
        # a load that fails on the last rank only
        {"op": "arm", "spec": {"fail_loads": {"rank": last, "count": 1}}},
        reset,
        {**gen, "name": "batch_failed_load"},
        {"op": "settle", "name": "settled_failed_load"},
        # negative control: a wrong copy that reports success does change the tokens
        {"op": "arm", "spec": {"scramble_loads": {"rank": last, "count": 4}}},
        reset,
        {**gen, "name": "batch_scrambled"},
        # requests aborted while their loads are in flight on the last rank
        {"op": "arm", "spec": {"hold_loads": {"rank": last, "steps": 6}}},
        reset,
        {"op": "abort", "name": "abort", "prompts": p["batch"], "max_tokens": 8, "steps": 2},
        {"op": "settle", "name": "settled_abort"},
        {"op": "arm", "spec": {}},
        reset,
        {**gen, "name": "batch_after_abort"},
    ]
    if tp > 1:
        conn_steps += [
            # one rank applies an operation the others do not: the cache closes, then reopens
            {"op": "arm", "spec": {"diverge": {"rank": last, "step": 1}}},
            {"op": "generate", "name": "other_diverged", "prompts": p["other"], "max_tokens": 8},
            {"op": "settle", "name": "settled_diverged"},
            reset,
            {**gen, "name": "batch_after_divergence"},
        ]
    conn_steps.append({"op": "settle", "name": "settled"})
    ref_steps = [
        {**gen, "name": "batch"},
        conversation,
        {"op": "generate", "name": "other", "prompts": p["other"], "max_tokens": 8},
    ]
    return {
        "model": str(workdir / "model"),
        "tp": tp,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": [
            {"name": "ref", "prefix_caching": False, "steps": ref_steps},
            # 20 blocks of 32 tokens: less than the four conversations need together
            {"name": "conn", "connector": connector, "num_gpu_blocks_override": 20, "steps": conn_steps},
            {
                "name": "fresh",
                "connector": connector,
                # page 3 of the two prompts that have one: their hit stops a page short
                "corrupt_before": {"dir": str(store / f"rank{last}"), "prompts": p["batch"][2:], "page": 3},
                "steps": [{**gen, "name": "batch"}, {"op": "settle", "name": "settled"}],
            },
        ],
    }


def run(tp: int, workdir: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Make the model, run the plan in a subprocess; fail with the log's tail if it does not finish."""
    workdir.mkdir(parents=True, exist_ok=True)
    make_tiny_llama(workdir / "model", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
    return run_plan(plan(tp, workdir), workdir, timeout_s)


def run_plan(the_plan: dict[str, Any], workdir: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Run a plan (its model already made) in a subprocess; fail with the log's tail if it fails."""
    plan_file, out_file, log_file = workdir / "plan.json", workdir / "out.json", workdir / "driver.log"
    plan_file.write_text(json.dumps(the_plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_file, "w") as log:
        # Its own session: on a timeout the whole group goes (vLLM's engine core and workers too).
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), str(plan_file), str(out_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout_s} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0:
        tail = log_file.read_text()[-6000:]
        raise AssertionError(f"the vLLM driver failed ({code}); the end of its log:\n{tail}")
    return json.loads(out_file.read_text())


def total(stats: list[dict[str, Any]], key: str) -> list[int]:
    return [int(s.get(key, 0)) for s in stats]
