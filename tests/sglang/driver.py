"""One SGLang engine, run in a process of its own: ``python tests/sglang/driver.py SPEC.json OUT.json``.

Why a process per engine: a SGLang scheduler that fails to start kills its parent process with
SIGKILL, so the test process must never be that parent. The spec names the model, the TP size,
the tpcache store (``storage_url``) and the prompts (token ids); the driver serves the prompts one
at a time with greedy sampling and waits until the store has taken every write the engine started
(a file store's segments or a Redis store's key count stop changing). With ``second_pass`` it then
empties SGLang's device and host tiers (``flush_cache``, which leaves the store as it is) and
serves the prompts again. ``salted`` prompts (``[prompt, cache_salt]`` pairs) make one more pass.
With ``together`` (prompts) it then empties SGLang's cache again and submits those prompts in one
call, so they queue behind one another (``max_running_requests`` caps how many run at once); the
outputs keep the prompts' order. It writes what each prompt produced and where its cached prefix
came from, per pass. A ``last_prompt`` is served after that (after the output is written: a test
fault may end the engine on it); then it shuts the engine down.

With ``"cache": "radix"`` the engine runs without HiCache: SGLang's own radix cache, or with
``radix_backend`` the prefix cache registered under that name (``--radix-cache-backend``), and
no store; ``max_total_tokens`` sizes its KV pool.

Settings SGLang needs on a CPU-only machine (a test setup, not a deployment): the CPU engine
(``SGLANG_USE_CPU_ENGINE=1``), torch-native attention, one core per TP rank, and for HiCache the
``direct`` host<->device copy with the layer-first host layout (the shims in ``shims/`` say why).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

STORE_SETTLE_S = 2.0  # the store's files unchanged this long: every started write has landed
STORE_WAIT_S = 120.0


def _store_size(url: str) -> int:
    if url.startswith("file://"):
        store = Path(url[len("file://") :])
        return sum(p.stat().st_size for p in store.rglob("*.seg")) if store.exists() else 0
    import redis

    with redis.Redis.from_url(url) as client:
        return int(client.dbsize())


def _wait_store_settled(url: str) -> None:
    deadline = time.monotonic() + STORE_WAIT_S
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = _store_size(url)
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= STORE_SETTLE_S:
            return
        time.sleep(0.25)
    raise SystemExit(f"the store at {url} kept changing (or stayed empty) for {STORE_WAIT_S:.0f} s")


def engine_args(spec: dict) -> dict:
    base = {
        "model_path": spec["model"],
        "tp_size": spec["tp"],
        "device": "cpu",
        "dtype": "bfloat16",
        "attention_backend": "torch_native",
        "skip_tokenizer_init": True,
        "page_size": spec["page_size"],
        "max_total_tokens": spec.get("max_total_tokens", 4096),
        "mem_fraction_static": 0.05,
        "disable_cuda_graph": True,
        "random_seed": 0,
        "log_level": "warning",
    }
    if spec.get("max_running_requests"):
        base["max_running_requests"] = spec["max_running_requests"]
    if spec.get("cache") == "radix":
        return {**base, "radix_cache_backend": spec.get("radix_backend")}
    extra = {
        "backend_name": "tpcache",
        "module_path": "tpcache.integrations.sglang.storage",
        "class_name": "TPCacheHiCacheStorage",
        "interface_v1": 1,
        "storage_url": spec["storage_url"],
        # SGLang's own setting: prefetch from storage from one page on (its default is 256 tokens).
        "prefetch_threshold": spec["page_size"],
    }
    return {
        **base,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 2,
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "layer_first",
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(extra),
        "hicache_storage_prefetch_policy": "wait_complete",
    }


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if spec["tp"] > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(spec["tp"]))
    import sglang

    started = time.monotonic()
    engine = sglang.Engine(**engine_args(spec))
    start_s = time.monotonic() - started
    passes = []
    try:
        passes.append(_serve(engine, spec))
        if spec.get("storage_url"):
            _wait_store_settled(spec["storage_url"])
        if spec.get("second_pass"):
            if not engine.flush_cache().success:
                raise SystemExit("SGLang refused to flush its cache")
            passes.append(_serve(engine, spec))
        if spec.get("salted"):
            # Prompts with a cache salt each (None: no salt), after the passes, in a pass of their own.
            prompts = [p for p, _ in spec["salted"]]
            passes.append(_serve(engine, {**spec, "prompts": prompts}, [salt for _, salt in spec["salted"]]))
        if spec.get("store_dir"):
            _wait_store_settled(f"file://{spec['store_dir']}")
        if spec.get("together"):
            if not engine.flush_cache().success:
                raise SystemExit("SGLang refused to flush its cache")
            passes.append(_serve_together(engine, spec))
        Path(out_path).write_text(json.dumps({"passes": passes, "start_s": start_s}))
        if spec.get("last_prompt"):
            # A prompt that may end the engine (a test fault): what came before is written already.
            _serve(engine, {**spec, "prompts": [spec["last_prompt"]]})
    finally:
        engine.shutdown()


def _serve(engine, spec: dict, salts: list | None = None) -> dict:
    outputs, cached = [], []
    for i, prompt in enumerate(spec["prompts"]):
        (out,) = engine.generate(
            input_ids=[prompt],
            sampling_params={"temperature": 0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True},
            cache_salt=None if salts is None or salts[i] is None else [salts[i]],
        )
        outputs.append(out["output_ids"])
        details = out["meta_info"].get("cached_tokens_details") or {}
        cached.append({k: details.get(k, 0) for k in ("device", "host", "storage")})
        cached[-1]["total"] = out["meta_info"].get("cached_tokens", 0)
    return {"outputs": outputs, "cached": cached}


def _serve_together(engine, spec: dict) -> dict:
    outs = engine.generate(
        input_ids=spec["together"],
        sampling_params={"temperature": 0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True},
    )
    outputs, cached = [], []
    for out in outs:
        outputs.append(out["output_ids"])
        details = out["meta_info"].get("cached_tokens_details") or {}
        cached.append({k: details.get(k, 0) for k in ("device", "host", "storage")})
        cached[-1]["total"] = out["meta_info"].get("cached_tokens", 0)
    return {"outputs": outputs, "cached": cached}


if __name__ == "__main__":
    main(*sys.argv[1:3])
