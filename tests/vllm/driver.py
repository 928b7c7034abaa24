"""Runs vLLM engines one after another on a suite of plans and writes what they produced as JSON.

    python tests/vllm/driver.py SUITE.json OUT.json

A suite is ``{"runs": {name: plan}}``. A plan names the model directory, its dtype (default
bfloat16), the TP size and a list of engines, each with its connector settings (none: plain vLLM),
its own TP size where it differs from the plan's, and its steps. Every engine of every
plan runs in turn in this one process (vLLM spawns each engine's core and workers; this script is
their ``__main__``): one ``import vllm`` serves them all. Steps:

    {"op": "generate", "name": N, "prompts": [[ids...]], "max_tokens": K}
    {"op": "conversation", "name": N, "users": [[[ids...] per turn] per conversation], "max_tokens": K}
                                            ("reset": true: reset_prefix_cache before each turn)
                                            ("solo": true: each request alone, the same order)
    {"op": "reset_prefix_cache"}
    {"op": "arm", "spec": {...}}            faults on the workers (tpcache.integrations.vllm.faults)
    {"op": "abort", "name": N, "prompts": [...], "max_tokens": K, "steps": S}
                                            add the prompts, run S engine steps, abort them all
    {"op": "staggered", "name": N, "first": [ids], "first_tokens": K1, "prompts": [...], "max_tokens": K,
     "steps": S}                            add ``first``, run S engine steps, then add the prompts (their
                                            loads then run beside ``first``'s forward passes)
    {"op": "settle"}                        wait until every worker holds no lease and nothing is pending
    {"op": "stats", "name": N}              every worker's tpcache statistics
    {"op": "metrics", "name": N}            vLLM's Prometheus samples of tpcache and preemptions
                                            (in this process's registry; needs "log_stats")

An engine's ``corrupt_before`` ({"dir", "prompts", "page"}) damages stored pages before it starts;
``in_process`` runs its engine core in this process (see ``_layout``); ``log_stats`` turns vLLM's
stats loggers on; ``shutdown_timeout_s`` gives vLLM's shutdown that long (its engine core, and its
workers through ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) instead of its 5 s default, and records
``shutdown_s``; ``kv_events`` turns vLLM's KV events on (its ZMQ publisher on a loopback port) and
records every event it published, decoded by vLLM's own ``KVEventBatch`` decoder, as
``kv_events``: ``[{"type", "medium", "hashes"}]`` in order (block hashes as hex). Results: {run: {engine:
{step name: {"tokens": [...], "cached": [...]} | [stats per rank]}}}. Each engine also gets
``log``, the byte range of the log (this process's stdout, which vLLM's processes share) written
while it ran, and, where it raised (at start-up or in a step), ``error``: the engines after it
still run, so each scenario reports its own failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tpcache.testing.vllm_env import VLLM_CPU_ENV

ENV = {**VLLM_CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
STEP_GUARD_S = 300.0  # how long a step loop may run before the driver reports a hang


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=max_tokens)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(max_tokens), use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "cached": [o.num_cached_tokens or 0 for o in outs]}


def _conversation(
    llm: Any, users: list[list[list[int]]], max_tokens: int, reset: bool = False, solo: bool = False
) -> dict[str, Any]:
    """Every conversation's turn t at once: prompt = history + the user's turn t (with ``reset``,
    vLLM's own prefix cache emptied before each turn: every hit is the connector's). With ``solo``,
    each request runs alone (turn by turn, conversation by conversation), so its forward passes hold
    only its own tokens whenever vLLM schedules it: batch-mates decided by when lookups and loads
    land would change the low bits of a bfloat16 model's logits, and a near tie then flips a greedy
    token that no cache served. The results are in the same order either way: turn by turn."""
    history: list[list[int]] = [[] for _ in users]
    tokens: list[list[int]] = []
    cached: list[int] = []
    for turn in range(max(len(u) for u in users)):
        live = [i for i, u in enumerate(users) if turn < len(u)]
        for batch in [[i] for i in live] if solo else [live]:
            if reset:
                llm.reset_prefix_cache()
            prompts = [history[i] + users[i][turn] for i in batch]
            out = _generate(llm, prompts, max_tokens)
            for i, prompt, toks in zip(batch, prompts, out["tokens"], strict=True):
                history[i] = prompt + toks
            tokens += out["tokens"]
            cached += out["cached"]
    return {"tokens": tokens, "cached": cached}


def _stats(llm: Any) -> list[dict[str, Any]]:
    from tpcache.integrations.vllm.connector import worker_stats

    return llm.collective_rpc(worker_stats)


def _settle(llm: Any, in_process: bool, limit_s: float = 120.0) -> list[dict[str, Any]]:
    """Wait until no worker holds a lease or has work pending. vLLM's engine core process keeps
    stepping on its own while the connector reports work (delayed frees, copies to agree), so this
    only watches; an engine core in this process steps only when called, so this steps it."""
    deadline = time.monotonic() + limit_s
    while True:
        stats = _stats(llm)
        if all(s.get("leases", 1) == 0 and s.get("pending", 1) == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers still hold leases or copies after {limit_s} s: {stats}")
        if in_process:
            llm.llm_engine.step()
        time.sleep(0.05)


def _metrics() -> dict[str, float]:
    """vLLM's Prometheus samples (its stat logger in this process) of tpcache's counters and of
    preemptions, as {name[/tier]: value}."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:tpcache_") or sample.name == "vllm:num_preemptions_total":
                if sample.name.endswith("_created"):
                    continue
                tier = sample.labels.get("tier")
                key = f"{sample.name}/{tier}" if tier else sample.name
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _abort(llm: Any, prompts: list[list[int]], max_tokens: int, steps: int) -> dict[str, Any]:
    engine = llm.llm_engine
    ids = [f"abort-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, _sampling(max_tokens))
    finished: list[str] = []
    for _ in range(steps):
        finished += [o.request_id for o in engine.step() if o.finished]
    engine.abort_request(ids)
    deadline = time.monotonic() + STEP_GUARD_S  # a hang guard: the aborted requests leave in a few steps
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"aborted requests still in the engine after {STEP_GUARD_S:.0f} s"
        engine.step()
    return {"finished_before_abort": finished}


def _staggered(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    """One request running first, the prompts added after ``steps`` engine steps; their outputs."""
    engine = llm.llm_engine
    name = step["name"]
    engine.add_request(f"{name}-first", {"prompt_token_ids": step["first"]}, _sampling(step["first_tokens"]))
    done: dict[str, Any] = {}

    def collect() -> None:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o

    for _ in range(step["steps"]):
        collect()
    ids = [f"{name}-{i}" for i in range(len(step["prompts"]))]
    for rid, p in zip(ids, step["prompts"], strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, _sampling(step["max_tokens"]))
    deadline = time.monotonic() + STEP_GUARD_S  # a hang guard, not a budget: loads land at the machine's pace
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests unfinished after {STEP_GUARD_S:.0f} s"
        collect()
    return {
        "tokens": [list(done[r].outputs[0].token_ids) for r in ids],
        "cached": [done[r].num_cached_tokens or 0 for r in ids],
    }


def _corrupt(spec: dict[str, Any]) -> int:
    """Flip one payload byte of every stored record of page ``spec["page"]`` of each of
    ``spec["prompts"]`` under ``spec["dir"]``; returns how many records were hit."""
    from tpcache.core.hashing import as_token_bytes, hash_chain
    from tpcache.integrations.vllm.options import page_namespace
    from tpcache.io.storage.keys import StorageKey
    from tpcache.io.storage.record import HEADER_SIZE, decode_header, read_key_echo

    namespace = page_namespace("", spec["model"])
    targets = {hash_chain(as_token_bytes(p), spec["block_size"], namespace)[spec["page"]] for p in spec["prompts"]}
    hit = 0
    for path in sorted(Path(spec["dir"]).rglob("*")):
        if not path.is_file():
            continue
        data = bytearray(path.read_bytes())
        offset = 0
        while offset + HEADER_SIZE <= len(data):
            try:
                head = decode_header(bytes(data[offset : offset + HEADER_SIZE + 1024]), None)
            except ValueError:
                break
            key = StorageKey.decode(
                read_key_echo(bytes(data[offset : offset + HEADER_SIZE + head.key_len]), head).decode()
            )
            if head.live and key.page_hash in targets:
                data[offset + head.record_len - head.payload_len // 2] ^= 0xFF
                hit += 1
            offset += head.record_len
        path.write_bytes(bytes(data))
    return hit


@contextlib.contextmanager
def _layout(in_process: bool) -> Iterator[None]:
    """vLLM's default layout (an engine core process, a worker process per rank), or its engine
    core in this process (at TP=1 the worker too: nothing to spawn). In-process, the worker binds
    this thread to its core, and the processes spawned later would inherit that: undone after."""
    if not in_process:
        yield
        return
    affinity = os.sched_getaffinity(0)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # the in-process worker's process group, and vLLM's env cache
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.sched_setaffinity(0, affinity)


def run_engine(plan: dict[str, Any], engine: dict[str, Any], out: dict[str, Any]) -> None:
    """Start the engine, run its steps into ``out`` (so what ran before a failure is kept), shut it down."""
    with _layout(engine.get("in_process", False)):
        _run_engine(plan, engine, out)


class _EventListener:
    """A plain ZMQ SUB socket that vLLM's KV-event publisher connects to, read by a thread of its own."""

    def __init__(self) -> None:
        import threading

        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        # vLLM's publisher connects to a tcp://HOST:PORT endpoint (it binds only wildcards).
        self.endpoint = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[list[bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                self.frames.append(self.sub.recv_multipart())

    def close(self) -> list[dict[str, Any]]:
        """Every event received, decoded with vLLM's own decoder."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        time.sleep(0.5)  # the last step's batch
        self.stop.set()
        self.thread.join()
        self.sub.close(0)
        self.ctx.term()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        out = []
        for frames in self.frames:
            for ev in decoder.decode(frames[-1]).events:
                hashes = [h.hex() if isinstance(h, bytes) else str(h) for h in getattr(ev, "block_hashes", [])]
                out.append({"type": type(ev).__name__, "medium": getattr(ev, "medium", None), "hashes": hashes})
        return out


def _run_engine(plan: dict[str, Any], engine: dict[str, Any], out: dict[str, Any]) -> None:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": plan["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": plan.get("dtype", "bfloat16"),
        "block_size": plan.get("block_size", 32),
        "tensor_parallel_size": engine.get("tp", plan["tp"]),
        "max_model_len": plan.get("max_model_len", 2048),
        "enable_prefix_caching": engine.get("prefix_caching", True),
        "seed": 0,
    }
    if engine.get("max_num_seqs"):
        kwargs["max_num_seqs"] = engine["max_num_seqs"]
    if plan.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = plan["max_num_batched_tokens"]
    if engine.get("log_stats"):
        kwargs["disable_log_stats"] = False
    shutdown_timeout = engine.get("shutdown_timeout_s")
    if shutdown_timeout:
        os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(int(shutdown_timeout))
    else:
        os.environ.pop("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None)
    if engine.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = engine["num_gpu_blocks_override"]
    if engine.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TPCacheConnector",
            "kv_connector_module_path": "tpcache.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": engine["connector"],
        }
    listener = None
    if engine.get("kv_events"):
        listener = _EventListener()
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=listener.endpoint
        )
    started = time.monotonic()
    try:
        llm = LLM(**kwargs)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    out["startup_s"] = time.monotonic() - started
    try:
        for i, step in enumerate(engine["steps"]):
            op, name = step["op"], step.get("name", f"{step['op']}{i}")
            if op == "generate":
                out[name] = _generate(llm, step["prompts"], step["max_tokens"])
            elif op == "conversation":
                out[name] = _conversation(
                    llm, step["users"], step["max_tokens"], step.get("reset", False), step.get("solo", False)
                )
            elif op == "reset_prefix_cache":
                out[name] = llm.reset_prefix_cache()
            elif op == "arm":
                from tpcache.integrations.vllm.faults import arm_faults

                out[name] = llm.collective_rpc(arm_faults, args=(step["spec"],))
            elif op == "abort":
                out[name] = _abort(llm, step["prompts"], step["max_tokens"], step["steps"])
            elif op == "staggered":
                out[name] = _staggered(llm, {**step, "name": name})
            elif op == "settle":
                out[name] = _settle(llm, engine.get("in_process", False))
            elif op == "stats":
                out[name] = _stats(llm)
            elif op == "metrics":
                out[name] = _metrics()
            else:
                raise ValueError(f"unknown driver op {op!r}")
    finally:
        started = time.monotonic()
        llm.llm_engine.engine_core.shutdown(timeout=shutdown_timeout)
        out["shutdown_s"] = time.monotonic() - started
        del llm
        if listener is not None:
            out["kv_events"] = listener.close()


def _log_offset() -> int:
    """Where this process's stdout (the log) stands: vLLM's processes write through the same file."""
    sys.stdout.flush()
    sys.stderr.flush()
    return os.lseek(sys.stdout.fileno(), 0, os.SEEK_CUR)


def run_plan(plan: dict[str, Any], results: dict[str, Any]) -> None:
    for engine in plan["engines"]:
        out: dict[str, Any] = {}
        results[engine["name"]] = out
        start = _log_offset()
        try:
            if engine.get("corrupt_before"):
                spec = {**engine["corrupt_before"], "model": plan["model"], "block_size": plan.get("block_size", 32)}
                results.setdefault("corrupted", {})[engine["name"]] = _corrupt(spec)
            run_engine(plan, engine, out)
        except Exception as exc:  # the next engines still run; the tests reading this one fail with it
            traceback.print_exc()
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["log"] = [start, _log_offset()]


def main(argv: list[str]) -> int:
    suite = json.loads(Path(argv[1]).read_text())
    os.environ.update(ENV)
    results: dict[str, Any] = {}
    for name, plan in suite["runs"].items():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(plan.get("kv_space_gib", 1))
        results[name] = {}
        run_plan(plan, results[name])
        Path(argv[2]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
