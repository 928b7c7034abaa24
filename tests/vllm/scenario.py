"""The vLLM ring's scenarios: plans run by ``driver.py`` in a subprocess, several plans per driver.

The Llama plan (one per TP size): three engines run one after another on a random tiny Llama:

1. ``ref``: plain vLLM, its own prefix caching off: the tokens every other run must reproduce. It
   runs in-process (its engine core in the driver; at TP=1 its worker too), which spares the
   interpreters an engine start spawns: the same worker and model runner compute its tokens. The
   engines with tpcache keep vLLM's default layout, where the engine core's loop keeps stepping
   while the connector has work (``settle`` relies on it);
2. ``conn``: vLLM with tpcache (host tier and a storage directory), its stats loggers on, and fewer
   KV blocks than the multi-turn workload needs: the batch, the batch again after
   ``reset_prefix_cache``, the conversations, long decodes that vLLM preempts, then faults armed on
   one rank at run time, then copies by layer on a slow copy thread; at TP=2 it is given the time
   to shut down cleanly. vLLM's KV events are on: the driver reads its ZMQ stream;
3. ``fresh``: a new vLLM on the same storage directory, after the last rank's stored copy of one
   page of two prompts was damaged: hits come from storage and stop where a rank has no good copy
   (vLLM's KV events on here too).

The sliding-window plans, under vLLM's hybrid allocator: a tiny Gemma 2 at TP=1 and TP=2 (plain
vLLM in-process, vLLM with tpcache: the batch, again after ``reset_prefix_cache``, a failed load,
wrong copies of the sliding-window blocks, conversations with vLLM's cache emptied before each
turn; then a fresh engine on the same storage), and a tiny
Mistral at TP=1 (every layer windowed: plain vLLM, then with tpcache).

Every engine start costs a few fresh interpreters that import vLLM (its engine core and one
worker per rank), so the ring runs as two driver processes, one per xdist worker
(``tests/vllm/conftest.py``): every TP=1 engine in one, the TP=2 engines in the other.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from tpcache.testing.child import run_in_own_session
from tpcache.testing.tiny_model import make_tiny_gemma2, make_tiny_granite_mamba2, make_tiny_llama

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
VOCAB = 512
PREEMPT_TOKENS = 96  # generated per long prompt: four of them outgrow the 20-block pool
WINDOW = 2 * BLOCK  # the sliding-window models' window: shorter than the shared prefix
# The Mamba hybrid's page: vLLM raises the attention block size until an attention block holds as
# many bytes as a Mamba state (96 tokens for ``make_tiny_granite_mamba2`` at TP=1 and TP=2).
MAMBA_PAGE = 96
# Prompt lengths: one token past a page boundary, so that the next token reads the state loaded there
MAMBA_PROMPTS = (3 * MAMBA_PAGE + 1, 2 * MAMBA_PAGE + 1, MAMBA_PAGE + 1)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def prompts(seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    prefix = _ids(rng, 3 * BLOCK)
    batch = [prefix + _ids(rng, 20 + 7 * i) for i in range(4)]
    other = [_ids(rng, 2 * BLOCK) + _ids(rng, 10 + i) for i in range(2)]  # fresh prefixes (divergence)
    users = [[_ids(rng, 40 + 9 * t + 3 * c) for t in range(3)] for c in range(4)]
    long = [_ids(rng, 3 * BLOCK + 17) for _ in range(4)]  # with PREEMPT_TOKENS each: more than 20 blocks
    return {"batch": batch, "other": other, "users": users, "long": long}


def plan(tp: int, workdir: Path, dtype: str = "float32") -> dict[str, Any]:
    p = prompts()
    store = workdir / "store"
    last = tp - 1
    last_owner = store / "model" / f"r{last}of{tp}"  # the last rank's own shard records
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
        # four requests that outgrow vLLM's blocks while decoding: vLLM preempts some of them
        {"op": "metrics", "name": "metrics_before_preemption"},
        {"op": "generate", "name": "preempted", "prompts": p["long"], "max_tokens": PREEMPT_TOKENS},
        {"op": "metrics", "name": "metrics_preempted"},
        {"op": "settle", "name": "settled_preempted"},
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
    conn_steps += [
        # copies by layer on a slow copy thread (the last rank's): the batch's loads start while
        # another request's forward passes run, and every copy is checked once it landed
        {"op": "settle", "name": "settled_before_delay"},
        {"op": "arm", "spec": {"delay_copies": {"rank": last, "seconds": 0.02}}},
        reset,
        {
            "op": "staggered",
            "name": "batch_delayed",
            "first": _ids(random.Random(7), 2 * BLOCK + 5),
            "first_tokens": 24,
            "prompts": p["batch"],
            "max_tokens": 8,
            "steps": 3,
        },
        {"op": "stats", "name": "stats_delayed"},
        {"op": "arm", "spec": {}},
        {"op": "settle", "name": "settled"},
        {"op": "metrics", "name": "metrics_end"},
    ]
    ref_steps = [
        {**gen, "name": "batch"},
        conversation,
        {"op": "generate", "name": "long", "prompts": p["long"], "max_tokens": PREEMPT_TOKENS},
        {"op": "generate", "name": "other", "prompts": p["other"], "max_tokens": 8},
    ]
    return {
        "model": str(workdir / "model"),
        "tp": tp,
        # The model computes in float32 on CPU: in bfloat16 a request's greedy tokens depend on its
        # batch-mates, which vary with when lookups land, and a near tie of this random model then
        # flips a token that no cache served (the Gemma 2 plan's comment says more). The CUDA ring
        # keeps bfloat16, which vLLM's FlashAttention path needs.
        "dtype": dtype,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": [
            {"name": "ref", "prefix_caching": False, "in_process": True, "steps": ref_steps},
            # 20 blocks of 32 tokens: less than the four conversations need together
            {
                "name": "conn",
                # copies by layer on a copy thread (on CPU "auto" copies after the forward pass,
                # as "fresh" does): both paths serve the same prompts
                "connector": {**connector, "copy_by_layer": True},
                "num_gpu_blocks_override": 20,
                "log_stats": True,
                "kv_events": True,  # vLLM's KV events, tpcache's tiers among them
                # vLLM's 5 s grace periods are shorter than its workers take to exit on two busy cores
                "shutdown_timeout_s": 60 if tp > 1 else None,
                "steps": conn_steps,
            },
            {
                "name": "fresh",
                # loads asynchronous (the request waits out of the batch for them); "conn" loads
                # synchronously, as "auto" does with one KV cache group
                "connector": {**connector, "load_mode": "async"},
                "log_stats": True,
                "kv_events": True,
                # page 3 of the two prompts that have one: their hit stops a page short
                "corrupt_before": {"dir": str(last_owner), "prompts": p["batch"][2:], "page": 3},
                "steps": [
                    {**gen, "name": "batch"},
                    {"op": "settle", "name": "settled"},
                    {**gen, "name": "batch_again"},  # its output brings the settled steps' stats
                    {"op": "metrics", "name": "metrics"},
                ],
            },
        ],
    }


def _tp1_plan(workdir: Path, engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": str(workdir / "model"),
        "tp": 1,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": engines,
    }


def _generate(name: str) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": prompts()["batch"], "max_tokens": 8}


def gemma_plan(workdir: Path, tp: int = 1) -> dict[str, Any]:
    """Interleaved sliding-window and full layers under vLLM's hybrid allocator (the connector
    declares hybrid support, so vLLM keeps it on, with its own prefix caching): token-identical,
    hits past the window after ``reset_prefix_cache``, a failed load on one rank recomputed, a
    wrong copy of the sliding-window blocks only (one component's bytes) changing the tokens, and
    storage hits in a fresh engine."""
    make_tiny_gemma2(workdir / "model", sliding_window=WINDOW)
    store = workdir / "store"
    last = tp - 1
    reset = {"op": "reset_prefix_cache"}
    connector = {"host_pages": 256, "storage_dir": str(store)}
    conn = [
        _generate("batch"),
        reset,
        _generate("batch_again"),
        {"op": "settle", "name": "settled"},
        {"op": "arm", "spec": {"fail_loads": {"rank": last, "count": 1}}},
        reset,
        _generate("batch_failed_load"),
        {"op": "settle", "name": "settled_failed_load"},
        # negative control: zeroing only the sliding-window layers' loaded blocks changes the tokens
        {"op": "arm", "spec": {"scramble_loads": {"rank": last, "count": 4, "group": "sliding"}}},
        reset,
        _generate("batch_scrambled"),
        {"op": "arm", "spec": {}},
        {"op": "settle", "name": "settled_scrambled"},
    ]
    # multi-turn, vLLM's cache emptied before each turn: the history's pages computed while decoding
    # (whose window blocks vLLM freed as the window moved on) come back from tpcache
    # one request at a time in both engines: the same forward passes whenever tpcache's lookups and
    # loads let vLLM schedule each (driver._conversation's ``solo``)
    users = prompts()["users"]
    conversation = {"op": "conversation", "name": "conversation", "users": users, "max_tokens": 40, "solo": True}
    conn += [{**conversation, "reset": True}, {"op": "settle", "name": "settled_conversation"}]
    ref = [_generate("batch"), conversation]
    fresh = [_generate("batch"), {"op": "settle", "name": "settled"}]
    return {
        **_tp1_plan(
            workdir,
            [
                {"name": "ref", "prefix_caching": False, "in_process": True, "steps": ref},
                {
                    "name": "conn",
                    "connector": connector,
                    "shutdown_timeout_s": 60 if tp > 1 else None,
                    "steps": conn,
                },
                {"name": "fresh", "connector": connector, "steps": fresh},
            ],
        ),
        "tp": tp,
        # KV in float32: a page a hit brings back was computed partly while decoding, and the engine
        # alone computes it in one prefill. In bfloat16 the two differ by a rounding step in some
        # values (95 of a page's 8,192 on one rank, by at most 0.0625), and a near tie of this random
        # model's greedy token then flips with no cache involved; in float32 they differ by about
        # 2**-16 of that.
        "dtype": "float32",
    }


def mamba_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [_ids(rng, n) for n in MAMBA_PROMPTS]


def mamba_plan(workdir: Path, tp: int = 1) -> dict[str, Any]:
    """A Granite-style Mamba2 hybrid under vLLM's hybrid allocator with vLLM's prefix caching off
    (so every hit is tpcache's; vLLM then keeps one Mamba state block per request). Prefill chunks
    of one page (``max_num_batched_tokens``) end at page boundaries, where the state is saved.
    First each prompt alone, then the batch: token-identical, the batch's hits up to the last page
    before each prompt's last token; a load failed on one rank recomputed; zeroed state blocks
    change the tokens; a fresh engine hits storage."""
    make_tiny_granite_mamba2(workdir / "model")
    store = workdir / "store"
    last = tp - 1
    batch = mamba_prompts()
    alone = [{"op": "generate", "name": f"alone{i}", "prompts": [p], "max_tokens": 8} for i, p in enumerate(batch)]

    def gen(name: str) -> dict[str, Any]:
        return {"op": "generate", "name": name, "prompts": batch, "max_tokens": 8}

    connector = {"host_pages": 64, "storage_dir": str(store)}
    conn = [
        *alone,
        gen("batch"),
        {"op": "settle", "name": "settled"},
        {"op": "arm", "spec": {"fail_loads": {"rank": last, "count": 1}}},
        gen("batch_failed_load"),
        {"op": "settle", "name": "settled_failed_load"},
        # negative control: zeroing only the loaded Mamba state blocks changes the tokens
        {"op": "arm", "spec": {"scramble_loads": {"rank": last, "count": len(batch), "group": "state"}}},
        gen("batch_scrambled"),
        {"op": "arm", "spec": {}},
        {"op": "settle", "name": "settled_scrambled"},
    ]
    no_prefix_caching = {"prefix_caching": False}
    return {
        "model": str(workdir / "model"),
        "tp": tp,
        "block_size": 16,
        "max_model_len": 512,
        "max_num_batched_tokens": MAMBA_PAGE,
        "kv_space_gib": 1,
        "engines": [
            {"name": "ref", **no_prefix_caching, "in_process": True, "steps": alone},
            {
                "name": "conn",
                **no_prefix_caching,
                "connector": connector,
                "shutdown_timeout_s": 60 if tp > 1 else None,
                "steps": conn,
            },
            # storage hits in a fresh engine: the batch once, then the workers' counters as they
            # stand. Its engine core runs in the driver (one interpreter fewer to start; at TP=1 the
            # worker too): its steps come milliseconds apart, faster than the storage reads land, and
            # a lookup waits for them by seconds (lookup_timeout_s), not by steps
            {
                "name": "fresh",
                **no_prefix_caching,
                "in_process": True,
                "connector": connector,
                "steps": [gen("batch"), {"op": "stats", "name": "stats"}],
            },
        ],
    }


def mistral_plan(workdir: Path) -> dict[str, Any]:
    """Every layer sliding-window (one group, whose blocks behind the window vLLM frees while a
    request runs): token-identical, and hits past the window after ``reset_prefix_cache``."""
    make_tiny_llama(workdir / "model", sliding_window=WINDOW)
    reset = {"op": "reset_prefix_cache"}
    conn = [_generate("batch"), reset, _generate("batch_again"), {"op": "settle", "name": "settled"}]
    return _tp1_plan(
        workdir,
        [
            {"name": "ref", "prefix_caching": False, "in_process": True, "steps": [_generate("batch")]},
            {"name": "conn", "connector": {"host_pages": 64}, "steps": conn},
        ],
    )


def llama_plan(tp: int, workdir: Path, dtype: str = "float32") -> dict[str, Any]:
    """The Llama plan for ``tp``, its model made in ``workdir``, computing in ``dtype``."""
    make_tiny_llama(workdir / "model", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
    return plan(tp, workdir, dtype)


def cross_tp_plan(workdir: Path) -> dict[str, Any]:
    """One storage directory, engines of two TP sizes on one float32 model with 4 KV heads (its
    path, and so its identity, the same for all): TP=2 writes the batch, a fresh TP=1 reads it and
    writes another batch, a fresh TP=2 reads that one. Float32, so both sizes compute the same KV up
    to a rounding far below a token's; ``ref`` is plain vLLM at TP=1, its prefix caching off."""
    make_tiny_llama(workdir / "model", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32)
    first, second = prompts()["batch"], prompts(seed=2)["batch"]
    connector = {"host_pages": 256, "storage_dir": str(workdir / "store")}

    def gen(name: str, batch: list[list[int]]) -> dict[str, Any]:
        return {"op": "generate", "name": name, "prompts": batch, "max_tokens": 8}

    return {
        "model": str(workdir / "model"),
        "dtype": "float32",
        "tp": 2,
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_space_gib": 1,
        "engines": [
            {
                "name": "ref",
                "tp": 1,
                "prefix_caching": False,
                "in_process": True,
                "steps": [gen("first", first), gen("second", second)],
            },
            {
                "name": "tp2_writes",
                "connector": connector,
                "steps": [gen("first", first), {"op": "settle", "name": "settled"}],
            },
            {
                "name": "tp1_reads",
                "tp": 1,
                "connector": connector,
                "steps": [
                    gen("first", first),
                    {"op": "settle", "name": "settled_first"},
                    gen("second", second),
                    {"op": "settle", "name": "settled"},
                ],
            },
            {
                "name": "tp2_reads",
                "connector": connector,
                "steps": [gen("second", second), {"op": "settle", "name": "settled"}],
            },
        ],
    }


class Results(dict):
    """One plan's results, by engine. Reading an engine that raised fails the reading test with
    that engine's error and the end of its part of the driver's log, so a failure shows in the
    tests of its own scenario while the others still pass."""

    def __init__(self, data: dict[str, Any], log: bytes) -> None:
        super().__init__(data)
        self._log = log

    def __getitem__(self, engine: str) -> Any:
        value = super().__getitem__(engine)
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(
                f"vLLM engine {engine!r} failed: {value['error']}\nthe end of its log:\n{self.log(engine)[-6000:]}"
            )
        return value

    def error(self, engine: str) -> str | None:
        """What the engine raised, or None where it ran to the end."""
        return super().__getitem__(engine).get("error")

    def started(self, engine: str) -> bool:
        """Whether vLLM came up (its constructor returned) for this engine."""
        return "startup_s" in super().__getitem__(engine)

    def log(self, engine: str) -> str:
        """What the driver and the engine's processes logged while it ran."""
        start, end = super().__getitem__(engine)["log"]
        return self._log[start:end].decode(errors="replace")


def run(tp: int, workdir: Path, timeout_s: float = 840, dtype: str = "float32") -> Results:
    """The Llama plan at ``tp`` alone in one driver run."""
    workdir.mkdir(parents=True, exist_ok=True)
    return run_suite({"llama": llama_plan(tp, workdir / "llama", dtype)}, workdir, timeout_s)["llama"]


def run_suite(plans: dict[str, dict[str, Any]], workdir: Path, timeout_s: float = 840) -> dict[str, Results]:
    """Run the plans (their models already made) in one driver subprocess, one after another;
    fail with the log's tail if the driver itself does not finish."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file, out_file, log_file = workdir / "suite.json", workdir / "out.json", workdir / "driver.log"
    plan_file.write_text(json.dumps({"runs": plans}))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Its own session: on a timeout the whole group goes (vLLM's engine core and workers too).
    code = run_in_own_session(
        [sys.executable, str(DRIVER), str(plan_file), str(out_file)], log_file, env, timeout_s, workdir
    )
    text = log_file.read_bytes()
    if code != 0:
        tail = text[-6000:].decode(errors="replace")
        raise AssertionError(f"the vLLM driver failed ({code}); the end of its log:\n{tail}")
    return {name: Results(out, text) for name, out in json.loads(out_file.read_text()).items()}


def total(stats: list[dict[str, Any]], key: str) -> list[int]:
    return [int(s.get(key, 0)) for s in stats]
