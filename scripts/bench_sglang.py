"""Benchmark SGLang with tpcache, in one of two modes.

``--mode prefix``: the prefix cache on a multi-turn conversation workload
(tpcache.workload.synthetic, as ``bench_vllm.py`` makes it, scaled to ``--max-model-len``), one
request at a time, one output token each. Sides: ``sglang-radix`` (SGLang's own radix cache: the
floor), ``sglang-hicache`` (SGLang's HiCache: its radix cache with a host tier, ``--hicache-ratio``)
and ``tpcache`` (``--radix-cache-backend tpcache``, with a host tier as large as HiCache's). The
device KV pool (``--kv-tokens``) is smaller than the conversations need together, so the caches must
evict. Per side, the median of the repeats with the spread (min, max) of: prefill tokens computed,
TTFT p50 and p90 (one output token: the request's wall time), and the scheduler thread's CPU time
per scheduler step spent in the prefix cache's methods, with the part of it spent in the collectives
those methods issue (SGLang's gloo all-reduces, tpcache's round), from
``tpcache.integrations.sglang.timing`` inside each scheduler process, the largest over the TP ranks;
then each side's ratios against ``sglang-radix``.

``--mode l3`` (the default): SGLang HiCache's storage tier (L3) read by a fresh engine, tpcache's
file store against SGLang's own ``file`` backend, and against no storage tier at all (the floor:
every prompt computed).

For each storage side and each repeat: one engine serves the prompts and writes their pages
through to an empty store, then a fresh engine on that store serves the same prompts again, one
at a time, one output token each; the second engine's numbers are kept. ``none`` runs the second
engine alone, without a storage tier. Every engine runs in a process of its own (a SGLang
scheduler that fails kills its parent).

Per side, the median of the repeats with the spread (min, max) of:
- ``prefill_tokens``: prompt tokens the second engine computed (the rest came from storage);
- ``ttft_p50_s``, ``ttft_p90_s``: time to the first token of each prompt (one output token: the
  request's wall time);
and ``same_tokens``: whether every side's output equals the no-storage engine's.

Usage (needs SGLang's venv, ``make setup-sglang``; on a CPU-only machine it runs SGLang as the test
ring does, a test setup whose times say little about GPUs):

    .venv-sglang/bin/python scripts/bench_sglang.py --json [--tp 1] [--prompts 8] [--prompt-tokens 512] [--repeats 3]
    .venv-sglang/bin/python scripts/bench_sglang.py --mode prefix --tp 2 [--requests 24] [--kv-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sglang.engines import plugin_dist  # noqa: E402
from tpcache.testing.child import run_in_own_session  # noqa: E402

SHIMS = ROOT / "tests" / "sglang" / "shims"
PAGE = 16
SIDES = ("none", "sglang-file", "tpcache-file")
PREFIX_SIDES = ("sglang-radix", "sglang-hicache", "tpcache")
TIMING_ENV = "TPCACHE_SGLANG_TIMING"


def _engine_args(spec: dict) -> dict:
    args = {
        "model_path": spec["model"],
        "tp_size": spec["tp"],
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "page_size": PAGE,
        "random_seed": 0,
        "log_level": "warning",
        "max_total_tokens": spec["max_total_tokens"],
    }
    if spec["cpu"]:
        args.update(device="cpu", attention_backend="torch_native", mem_fraction_static=0.05, disable_cuda_graph=True)
    if spec["side"] in ("none", "sglang-radix"):
        return args
    if spec["side"] == "tpcache":
        return {**args, "radix_cache_backend": "tpcache"}
    args.update(
        enable_hierarchical_cache=True,
        hicache_ratio=spec.get("hicache_ratio", 2),
        hicache_write_policy="write_through",
        hicache_storage_prefetch_policy="wait_complete",
    )
    if spec["cpu"]:
        args.update(hicache_io_backend="direct", hicache_mem_layout="layer_first")
    if spec["side"] == "sglang-hicache":
        return args
    extra: dict = {"prefetch_threshold": PAGE}
    if spec["side"] == "sglang-file":
        args["hicache_storage_backend"] = "file"
        extra["file_storage_path"] = spec["store"]
    else:
        args["hicache_storage_backend"] = "dynamic"
        extra.update(
            backend_name="tpcache",
            module_path="tpcache.integrations.sglang.storage",
            class_name="TPCacheHiCacheStorage",
            interface_v1=1,
            storage_url="file://" + spec["store"],
            capacity="4GiB",
        )
    args["hicache_storage_backend_extra_config"] = json.dumps(extra)
    return args


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store.exists() else 0


def _settle(store: Path, quiet_s: float = 2.0, limit_s: float = 300.0) -> None:
    """Wait until the store stops growing: every write the engine started has landed."""
    deadline, last, since = time.monotonic() + limit_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = _store_bytes(store)
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)
    raise SystemExit(f"the store in {store} kept changing (or stayed empty) for {limit_s:.0f} s")


def run_engine(spec_file: str, out_file: str) -> None:
    """One engine (this process is its parent): serve the prompts, report each one's numbers."""
    spec = json.loads(Path(spec_file).read_text())
    if spec["cpu"]:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        if spec["tp"] > 1:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(r % (os.cpu_count() or 1)) for r in range(spec["tp"])
            )
    import sglang

    engine = sglang.Engine(**_engine_args(spec))
    rows = []
    try:
        for prompt in spec["prompts"]:
            t0 = time.perf_counter()
            (out,) = engine.generate(
                input_ids=[prompt], sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
            )
            rows.append(
                {
                    "ttft_s": time.perf_counter() - t0,
                    "cached": int(out["meta_info"].get("cached_tokens") or 0),
                    "tokens": out["output_ids"],
                }
            )
        if spec.get("store") and spec["side"] != "none" and spec["write"]:
            _settle(Path(spec["store"]))
    finally:
        engine.shutdown()
    Path(out_file).write_text(json.dumps(rows))


def _child(workdir: Path, name: str, spec: dict, timeout_s: float) -> list[dict]:
    spec_file, out_file, log_file = workdir / f"{name}.json", workdir / f"{name}.out", workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    paths = ([str(SHIMS)] if spec["cpu"] else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if spec.get("timing"):
        # tpcache's plugin (its entry point from pyproject.toml) measures the prefix cache in each scheduler.
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_dist(workdir / f"{name}-plugin")), env["PYTHONPATH"]])
        env[TIMING_ENV] = spec["timing"]
    if spec.get("host_pages"):
        env["TPCACHE_SGLANG_HOST_PAGES"] = str(spec["host_pages"])
    code = run_in_own_session(
        [sys.executable, __file__, "--engine", str(spec_file), str(out_file)], log_file, env, timeout_s
    )
    if code != 0 or not out_file.exists():
        tail = log_file.read_bytes()[-4000:].decode(errors="replace")
        raise SystemExit(f"engine {name} failed ({code}); the end of its log:\n{tail}")
    return json.loads(out_file.read_text())


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _timing(directory: Path) -> list[dict]:
    """Each scheduler's counts (one file per TP rank's process)."""
    return [json.loads(f.read_text()) for f in sorted(directory.glob("sched-*.json"))]


def multi_turn(args: argparse.Namespace) -> list[list[int]]:
    """The multi-turn conversation prompts, as ``bench_vllm.py`` makes them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_vllm import workload

    return workload(argparse.Namespace(**{**vars(args), "workload": "multi-turn", "wave": args.conversations}))


def prefix(args: argparse.Namespace, workdir: Path, model: str) -> dict:
    sides = [s for s in args.sides.split(",") if s] if args.sides else list(PREFIX_SIDES)
    unknown = [s for s in sides if s not in PREFIX_SIDES]
    if unknown:
        raise SystemExit(f"--sides: unknown side {unknown[0]!r} for --mode prefix; known: {', '.join(PREFIX_SIDES)}")
    prompts = multi_turn(args)
    base = {"model": model, "tp": args.tp, "cpu": not args.gpu, "prompts": prompts, "max_total_tokens": args.kv_tokens}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.repeats):
        for side in sides:  # interleaved: each repeat runs every side once
            name = f"{side}-{r}"
            timing = workdir / f"{name}-timing"
            spec = {**base, "side": side, "timing": str(timing), "hicache_ratio": args.hicache_ratio}
            if side == "tpcache":  # a host tier as large as HiCache's (--hicache-ratio times the device pool)
                spec["host_pages"] = int(args.hicache_ratio * args.kv_tokens) // PAGE
            rows = _child(workdir, name, spec, args.timeout_s)
            runs[side].append({"rows": rows, "scheds": _timing(timing)})
    reference = runs[sides[0]][0]["rows"]
    result: dict = {
        "mode": "prefix",
        "tp": args.tp,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "kv_tokens": args.kv_tokens,
        "sides": {},
    }
    for side, reps in runs.items():
        per_step = []
        for rep in reps:
            scheds = rep["scheds"]
            if len(scheds) != args.tp or not all(s["steps"] for s in scheds):
                raise SystemExit(f"{side}: {len(scheds)} of {args.tp} schedulers reported their prefix cache's time")
            per_step.append(
                (
                    max(s["cache_cpu_s"] / s["steps"] for s in scheds) * 1e6,
                    max(s["collective_cpu_s"] / s["steps"] for s in scheds) * 1e6,
                    max(s["collectives"] / s["steps"] for s in scheds),
                    statistics.median(s["steps"] for s in scheds),
                )
            )
        rows = [rep["rows"] for rep in reps]
        result["sides"][side] = {
            "prefill_tokens": _summary(
                [sum(len(p) - row["cached"] for p, row in zip(prompts, rr, strict=True)) for rr in rows]
            ),
            "ttft_p50_s": _summary([_quantile([row["ttft_s"] for row in rr], 0.5) for rr in rows]),
            "ttft_p90_s": _summary([_quantile([row["ttft_s"] for row in rr], 0.9) for rr in rows]),
            "cache_cpu_us_per_step": _summary([p[0] for p in per_step]),
            "collective_cpu_us_per_step": _summary([p[1] for p in per_step]),
            "collectives_per_step": _summary([p[2] for p in per_step]),
            "steps": _summary([p[3] for p in per_step]),
            "same_tokens": all([row["tokens"] for row in rr] == [row["tokens"] for row in reference] for rr in rows),
        }
    floor = result["sides"][sides[0]]
    for got in result["sides"].values():
        got["ratio_to_" + sides[0]] = {
            key: got[key]["median"] / floor[key]["median"] if floor[key]["median"] else None
            for key in ("prefill_tokens", "ttft_p50_s", "ttft_p90_s", "cache_cpu_us_per_step")
        }
    return result


def _spread(s: dict, key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
    return f"{s[key]['median'] * scale:{fmt}} [{s[key]['min'] * scale:{fmt}}, {s[key]['max'] * scale:{fmt}}]"


def _print_prefix(result: dict) -> None:
    print(
        f"TP={result['tp']}, {result['requests']} requests, {result['prompt_tokens']} prompt tokens, "
        f"KV pool {result['kv_tokens']} tokens; medians [min, max]"
    )
    for side, s in result["sides"].items():
        ratio = next(v for k, v in s.items() if k.startswith("ratio_to_"))
        print(
            f"{side:>15}: prefill {_spread(s, 'prefill_tokens')} tokens;"
            f" TTFT p50 {_spread(s, 'ttft_p50_s', 1e3, '.1f')} ms, p90 {_spread(s, 'ttft_p90_s', 1e3, '.1f')} ms;"
            f" prefix cache CPU {_spread(s, 'cache_cpu_us_per_step')} us a step, of it collectives"
            f" {_spread(s, 'collective_cpu_us_per_step')} us ({s['collectives_per_step']['median']:.1f} a step);"
            f" same tokens: {s['same_tokens']}"
        )
        print(" " * 17 + "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items() if v is not None))


def l3(args: argparse.Namespace, workdir: Path, model: str) -> dict:
    sides = [s for s in args.sides.split(",") if s] if args.sides else list(SIDES)
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"--sides: unknown side {unknown[0]!r}; known: {', '.join(SIDES)}")
    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(args.prompt_tokens)] for i in range(1, args.prompts + 1)]
    base = {
        "model": model,
        "tp": args.tp,
        "cpu": not args.gpu,
        "prompts": prompts,
        "max_total_tokens": max(4096, 2 * args.prompt_tokens),
    }
    runs: dict[str, list[list[dict]]] = {s: [] for s in sides}
    for r in range(args.repeats):
        for side in sides:
            store = workdir / f"{side}-{r}"
            spec = {**base, "side": side, "store": str(store)}
            if side != "none":
                _child(workdir, f"{side}-{r}-write", {**spec, "write": True}, args.timeout_s)
            runs[side].append(_child(workdir, f"{side}-{r}-read", {**spec, "write": False}, args.timeout_s))
            shutil.rmtree(store, ignore_errors=True)
    reference = runs["none"][0] if "none" in runs else None
    result: dict = {"tp": args.tp, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "sides": {}}
    for side, reps in runs.items():
        prefill = [sum(args.prompt_tokens - row["cached"] for row in rows) for rows in reps]
        p50 = [_quantile([row["ttft_s"] for row in rows], 0.5) for rows in reps]
        p90 = [_quantile([row["ttft_s"] for row in rows], 0.9) for rows in reps]
        same = None
        if reference is not None:
            same = all([row["tokens"] for row in rows] == [row["tokens"] for row in reference] for rows in reps)
        result["sides"][side] = {
            "prefill_tokens": _summary(prefill),
            "ttft_p50_s": _summary(p50),
            "ttft_p90_s": _summary(p90),
            "same_tokens": same,
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("l3", "prefix"), default="l3")
    ap.add_argument("--model", help="model directory (default: a random tiny Llama made here)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sides", default="", help="comma-separated (default: every side of the mode)")
    ap.add_argument("--gpu", action="store_true", help="run SGLang on its GPU defaults instead of the CPU test setup")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    l3_args = ap.add_argument_group("--mode l3")
    l3_args.add_argument("--prompts", type=int, default=8)
    l3_args.add_argument("--prompt-tokens", type=int, default=512)
    pre = ap.add_argument_group("--mode prefix")
    pre.add_argument("--max-model-len", type=int, default=2048, help="the workload's longest prompt + 1")
    pre.add_argument("--conversations", type=int, default=12)
    pre.add_argument("--turns", type=float, default=4.0)
    pre.add_argument("--requests", type=int, default=24)
    pre.add_argument("--kv-tokens", type=int, default=4096, help="SGLang's device KV pool (--max-total-tokens)")
    pre.add_argument("--hicache-ratio", type=float, default=2.0, help="sglang-hicache's host pool / device pool")
    pre.add_argument("--vocab", type=int, default=512, help="token ids drawn below this (the tiny model's vocabulary)")
    pre.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.engine:
        run_engine(*args.engine)
        return
    args.max_tokens = 1
    with tempfile.TemporaryDirectory(prefix="bench_sglang_") as tmp:
        workdir = Path(tmp)
        model = args.model
        if model is None:
            from tpcache.testing.tiny_model import make_tiny_llama

            longest = max(args.prompt_tokens * 2, args.max_model_len)
            model = str(make_tiny_llama(workdir / "model", max_position_embeddings=max(4096, longest)))
        result = (prefix if args.mode == "prefix" else l3)(args, workdir, model)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.mode == "prefix":
        _print_prefix(result)
    else:
        for side, s in result["sides"].items():
            print(
                f"{side:>13}: prefill tokens {s['prefill_tokens']['median']:.0f}, "
                f"TTFT p50 {s['ttft_p50_s']['median']:.3f} s "
                f"[{s['ttft_p50_s']['min']:.3f}, {s['ttft_p50_s']['max']:.3f}], "
                f"p90 {s['ttft_p90_s']['median']:.3f} s, same tokens: {s['same_tokens']}"
            )


if __name__ == "__main__":
    main()
