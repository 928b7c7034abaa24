"""vLLM with and without tpcache on a multi-turn conversation workload, in the same run.

    python scripts/bench_vllm.py --json                  # TP=2, 8-layer model of hidden 1024, CPU

The workload is the built-in conversation generator (tpcache.workload.synthetic), scaled to the
model's ``max_model_len``: every turn resends the conversation's history. Each trace block id
stands for a fixed run of token ids, so shared history is shared tokens. vLLM gets fewer KV
blocks than the conversations need together (``--vllm-blocks``), so its own prefix cache keeps
only part of them; with tpcache the rest comes back from the host tier instead of being computed.

Both engines run the same requests in the same waves (``--wave`` requests at a time, in trace
order), one engine after the other, on the same random checkpoint. Reported per engine: prefill
tokens computed, time to first token p50/p90 (the engine's own first-token latency), requests/s
over the whole workload (median of ``--runs`` passes with their spread), hit tokens by tier; then
the with/without ratios, and per request the cached/computed split of its prompt on each engine and
whether the two engines generated the same tokens (bf16 numerics may differ where the split does).
The floor is vLLM without tpcache, measured in the same run.

Two more figures say whether the model is one a cache can speed up, and what tpcache costs:

- ``prefill_to_copy``: the time to prefill one page (a fresh prompt on the engine without tpcache,
  per page of it) against the time to copy one page of this rank's KV into vLLM's blocks (torch's
  ``index_copy_`` into a block of every layer, as a load does). A cache lowers time to first token
  only where this is well above 1. Even then the tokens a request still computes attend over its
  cached prefix, work no prefix cache removes: the TTFT ratio approaches the prefill-token ratio only
  where a token's compute is mostly its weights (hence hidden 1024 by default; at hidden 512
  attention is a large share of this small model's prefill).
- ``connector_cpu``: with tpcache, the worker CPU time spent in the connector's hooks and in
  tpcache's own threads, against the worker's CPU time per engine step
  (``tpcache.integrations.vllm.timing``), per rank, median of the passes.
  ``--workload zero-hit`` sends prompts that share nothing, so tpcache only saves: its pure cost.

``load_wait_steps`` counts the engine steps requests sat out of the batch waiting for their loads
(vLLM's ``vllm:tpcache_load_wait_steps_total``): none where tpcache loads synchronously (its
``load_mode``), at least one per load otherwise. ``--model gemma2`` runs a random Gemma 2 of the
same size instead (sliding-window and full layers interleaved: two KV cache groups, which load
asynchronously). ``load_average`` is the machine's at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.testing.vllm_env import VLLM_CPU_ENV  # noqa: E402

PAGE_TOKENS = 32  # vLLM's block size here, and tpcache's page
ENV = {**VLLM_CPU_ENV, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout carries only the result


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Prompts (token ids) of the conversation generator, sized to max_model_len."""
    from tpcache.workload.synthetic import SyntheticWorkload
    from tpcache.workload.trace import TRACE_BLOCK_TOKENS

    scale = args.max_model_len / 8192  # the generator's lengths are for an 8k-token context
    gen = SyntheticWorkload(
        seed=args.seed,
        conversations=args.conversations,
        system_prompts=4,
        system_prompt_tokens=max(TRACE_BLOCK_TOKENS, int(2048 * scale)),
        mean_turns=args.turns,
        user_tokens_median=max(8, int(600 * scale)),
        answer_tokens_median=max(8, int(400 * scale)),
        concurrent=args.wave,
    )
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(h * 7919 + args.seed)
            blocks[h] = [rng.randrange(3, args.vocab) for _ in range(TRACE_BLOCK_TOKENS)]
        return blocks[h]

    limit = args.max_model_len - args.max_tokens
    fresh = random.Random(args.seed + 1)
    prompts = []
    for req in gen.requests():
        if req.input_length > limit:
            continue  # a conversation past the context ends there
        tokens = [t for h in req.hash_ids for t in block(h)][: req.input_length]
        if args.workload == "zero-hit":  # the same lengths, nothing shared: no hit anywhere
            tokens = [fresh.randrange(3, args.vocab) for _ in tokens]
        prompts.append(tokens)
        if len(prompts) == args.requests:
            break
    return prompts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def tier_stats(llm: Any) -> dict[str, int]:
    """Tokens rank 0 has loaded into vLLM's blocks so far, by the tier they came from."""
    from tpcache.integrations.vllm.connector import worker_stats

    s = llm.collective_rpc(worker_stats)[0]
    loaded, from_storage = s["loads_done_pages"] * s["page_size"], s["prefetch_read_pages"] * s["page_size"]
    return {"tpcache_host": loaded - min(loaded, from_storage), "tpcache_storage": min(loaded, from_storage)}


def prefill_seconds_per_page(llm: Any, args: argparse.Namespace) -> float:
    """Median wall time to prefill one 32-token page: fresh prompts of half the context, one at a
    time, one token generated (vLLM's own cache misses: every prompt is new)."""
    from vllm import SamplingParams

    rng = random.Random(args.seed + 2)
    n = args.max_model_len // 2
    one = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=1)
    llm.generate([{"prompt_token_ids": [5] * 64}], one, use_tqdm=False)  # warm
    times = []
    for _ in range(5):
        prompt = [rng.randrange(3, args.vocab) for _ in range(n)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        times.append((time.perf_counter() - start) / (n / PAGE_TOKENS))
    return statistics.median(times)


def copy_seconds_per_page(args: argparse.Namespace) -> float:
    """Median time to copy one page of one rank's KV (bf16, every layer, K and V) from host memory
    into a block of vLLM's per-layer KV tensors, as a load does (``index_copy_`` per layer)."""
    import torch

    heads = max(1, args.kv_heads // args.tp)
    blocks, head_dim = 64, args.hidden // args.heads
    caches = [torch.zeros(2, blocks, PAGE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(args.layers)]
    page = torch.randn(args.layers, 2, 1, PAGE_TOKENS, heads, head_dim).to(torch.bfloat16)
    times = []
    for i in range(200):
        target = torch.tensor([i % blocks])
        start = time.perf_counter()
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, target, page[layer])
        times.append(time.perf_counter() - start)
    return statistics.median(times[20:])


def load_wait_steps() -> float:
    """vLLM's counter of engine steps requests sat out of the batch for their tpcache loads (this
    process's Prometheus registry, where vLLM's stat logger keeps it)."""
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == "vllm:tpcache_load_wait_steps_total"
    )


def connector_cpu(llm: Any) -> dict[str, Any]:
    """Per rank: the connector's CPU (hooks + tpcache's threads) against the worker's step CPU."""
    from tpcache.integrations.vllm.timing import timing_stats

    ranks = []
    for s in llm.collective_rpc(timing_stats):
        spent = sum(s["hook_cpu_s"].values()) + s["threads_cpu_s"]
        ranks.append({**s, "share": spent / s["step_cpu_s"] if s["step_cpu_s"] else None})
    shares = [r["share"] for r in ranks if r["share"] is not None]
    return {"share": max(shares) if shares else 0.0, "ranks": ranks}


def run_engine(args: argparse.Namespace, model: Path, prompts: list[list[int]], tpcache: bool) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "block_size": PAGE_TOKENS,
        "tensor_parallel_size": args.tp,
        "max_model_len": args.max_model_len,
        "num_gpu_blocks_override": args.vllm_blocks,
        "disable_log_stats": False,
        "seed": 0,
    }
    if tpcache:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TimedTPCacheConnector",  # the connector, its hooks timed
            "kv_connector_module_path": "tpcache.integrations.vllm.timing",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pages": args.host_pages, **json.loads(args.connector_options)},
        }
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=args.max_tokens)
    passes = []
    prefill_page_s = None
    try:
        if not tpcache:
            prefill_page_s = prefill_seconds_per_page(llm, args)
        for _ in range(args.runs):
            # Each pass starts cold: vLLM's own cache empty, and tpcache's (an agreed flush, done by
            # the next engine step).
            llm.reset_prefix_cache(reset_connector=tpcache)
            llm.generate([{"prompt_token_ids": [5, 5]}], params, use_tqdm=False)
            before = tier_stats(llm) if tpcache else {}
            waits_before = load_wait_steps()
            if tpcache:
                from tpcache.integrations.vllm.timing import reset_timing

                llm.collective_rpc(reset_timing)
            ttft: list[float] = []
            computed = cached = 0
            outputs: list[list[int]] = []
            split: list[int] = []  # cached prompt tokens per request, in trace order
            start = time.perf_counter()
            for i in range(0, len(prompts), args.wave):
                wave = prompts[i : i + args.wave]
                outs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
                for p, out in zip(wave, outs, strict=True):
                    hit = out.num_cached_tokens or 0
                    cached += hit
                    computed += len(p) - hit
                    split.append(hit)
                    outputs.append(list(out.outputs[0].token_ids))
                    stats = getattr(out, "metrics", None)
                    if stats is not None and getattr(stats, "first_token_latency", 0):
                        ttft.append(stats.first_token_latency)
            seconds = time.perf_counter() - start
            after = tier_stats(llm) if tpcache else {}
            llm.generate([{"prompt_token_ids": [5, 5]}], params, use_tqdm=False)  # the last stats reach vLLM
            waits = load_wait_steps() - waits_before
            tiers = {k: after[k] - before[k] for k in after}
            cpu = connector_cpu(llm) if tpcache else None
            passes.append(
                {
                    "seconds": seconds,
                    "requests_per_s": len(prompts) / seconds,
                    "prefill_tokens_computed": computed,
                    "cached_tokens": cached,
                    "ttft_p50_s": percentile(ttft, 0.5),
                    "ttft_p90_s": percentile(ttft, 0.9),
                    "outputs": outputs,
                    "cached_per_request": split,
                    "tiers": tiers,
                    "connector_cpu": cpu,
                    "load_wait_steps": waits,
                }
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    rps = [p["requests_per_s"] for p in passes]
    best = passes[len(passes) // 2]
    shares = [p["connector_cpu"]["share"] for p in passes if p["connector_cpu"]]
    return {
        "prefill_seconds_per_page": prefill_page_s,
        "connector_cpu": None
        if not shares
        else {
            "share_of_step_cpu": statistics.median(shares),
            "spread": [min(shares), max(shares)],
            "passes": [p["connector_cpu"] for p in passes],
        },
        "requests_per_s": statistics.median(rps),
        "requests_per_s_spread": [min(rps), max(rps)],
        "prefill_tokens_computed": statistics.median(p["prefill_tokens_computed"] for p in passes),
        "ttft_p50_s": statistics.median(p["ttft_p50_s"] for p in passes),
        "ttft_p50_spread_s": [min(p["ttft_p50_s"] for p in passes), max(p["ttft_p50_s"] for p in passes)],
        "ttft_p90_s": statistics.median(p["ttft_p90_s"] for p in passes),
        "ttft_p90_spread_s": [min(p["ttft_p90_s"] for p in passes), max(p["ttft_p90_s"] for p in passes)],
        "load_wait_steps": statistics.median(p["load_wait_steps"] for p in passes),
        "hit_tokens": {"vllm_prefix_cache": best["cached_tokens"] - sum(best["tiers"].values()), **best["tiers"]},
        "outputs": best["outputs"],
        "cached_per_request": best["cached_per_request"],
    }


def ratios(without: dict[str, Any], with_tp: dict[str, Any]) -> dict[str, float | None]:
    return {
        "prefill_tokens_computed": with_tp["prefill_tokens_computed"] / max(1, without["prefill_tokens_computed"]),
        "ttft_p50": with_tp["ttft_p50_s"] / without["ttft_p50_s"] if without["ttft_p50_s"] else None,
        "ttft_p90": with_tp["ttft_p90_s"] / without["ttft_p90_s"] if without["ttft_p90_s"] else None,
        "requests_per_s": with_tp["requests_per_s"] / without["requests_per_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--wave", type=int, default=8, help="requests submitted together")
    ap.add_argument("--vllm-blocks", type=int, default=160, help="vLLM's own KV blocks (32 tokens each)")
    ap.add_argument("--host-pages", type=int, default=4096, help="tpcache host pages per rank")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload",
        choices=["conversation", "zero-hit"],
        default="conversation",
        help="zero-hit: the same prompt lengths with nothing shared (tpcache's cost alone)",
    )
    ap.add_argument(
        "--connector-options", default="{}", help="more connector settings, as JSON (e.g. '{\"copy_by_layer\": false}')"
    )
    ap.add_argument(
        "--model",
        choices=["llama", "gemma2"],
        default="llama",
        help="gemma2: a random Gemma 2 of the same size, sliding-window and full layers interleaved (two KV "
        "cache groups under vLLM's hybrid allocator); --window sets its window",
    )
    ap.add_argument("--window", type=int, default=512, help="gemma2's sliding window, in tokens")
    ap.add_argument(
        "--load-modes",
        default="",
        help="run the engine with tpcache once per connector load_mode listed (e.g. async,sync) against the same "
        "plain-vLLM run; by_load_mode gives each one's ratios, the rest of the output is the last one's",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from tpcache.testing.tiny_model import make_tiny_gemma2, make_tiny_llama

    prompts = workload(args)
    if not prompts:
        ap.error(f"no request of the workload fits --max-model-len {args.max_model_len}: raise it")
    with tempfile.TemporaryDirectory(prefix="tpcache-bench-vllm-") as tmp:
        shape = dict(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
            vocab_size=args.vocab,
            # Weights scaled to the width: a well-conditioned model (no near-ties in the logits that
            # a different prefill chunking could flip); the tests use a sharper one on purpose.
            std=args.hidden**-0.5,
        )
        if args.model == "gemma2":
            model = make_tiny_gemma2(Path(tmp) / "model", sliding_window=args.window, **shape)
        else:
            model = make_tiny_llama(
                Path(tmp) / "model",
                intermediate_size=2 * args.hidden,
                max_position_embeddings=args.max_model_len,
                **shape,
            )
        copy_page_s = copy_seconds_per_page(args)
        without = run_engine(args, model, prompts, tpcache=False)
        by_mode = {}
        base_options = args.connector_options
        for mode in args.load_modes.split(",") if args.load_modes else [""]:
            if mode:
                args.connector_options = json.dumps({**json.loads(base_options), "load_mode": mode})
            by_mode[mode] = run_engine(args, model, prompts, tpcache=True)
        with_tp = by_mode[mode]
    modes = {
        mode: {
            "ratios": ratios(without, run),
            "ttft_p50_spread_s": run["ttft_p50_spread_s"],
            "ttft_p90_spread_s": run["ttft_p90_spread_s"],
            "load_wait_steps": run["load_wait_steps"],
            "requests_with_different_tokens": sum(
                a != b for a, b in zip(without["outputs"], run["outputs"], strict=True)
            ),
        }
        for mode, run in by_mode.items()
        if mode
    }
    plain, cached = without.pop("outputs"), with_tp.pop("outputs")
    split_plain, split_cached = without.pop("cached_per_request"), with_tp.pop("cached_per_request")
    per_request = [
        {
            "prompt_tokens": len(p),
            "without_tpcache": {"cached": a, "computed": len(p) - a},
            "with_tpcache": {"cached": b, "computed": len(p) - b},
            "tokens_match": x == y,
        }
        for p, a, b, x, y in zip(prompts, split_plain, split_cached, plain, cached, strict=True)
    ]
    differing = sum(a != b for a, b in zip(plain, cached, strict=True))
    identical = differing == 0
    result = {
        "bench": "vllm",
        "tp": args.tp,
        "model": {
            "kind": args.model,
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            **({"window": args.window} if args.model == "gemma2" else {}),
        },
        "load_average": os.getloadavg(),
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "vllm_blocks": args.vllm_blocks,
        "workload": args.workload,
        "prefill_to_copy": without["prefill_seconds_per_page"] / copy_page_s,
        "copy_seconds_per_page": copy_page_s,
        "without_tpcache": without,
        "with_tpcache": with_tp,
        "tokens_identical": identical,
        "requests_with_different_tokens": differing,
        "per_request": per_request,
        "ratios": ratios(without, with_tp),
        **({"by_load_mode": modes} if modes else {}),
    }
    identical = identical and not any(m["requests_with_different_tokens"] for m in modes.values())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for i, req in enumerate(per_request):
            a, b = req["without_tpcache"], req["with_tpcache"]
            print(
                f"request {i}: {req['prompt_tokens']} prompt tokens; without tpcache {a['cached']} cached, "
                f"{a['computed']} computed; with tpcache {b['cached']} cached, {b['computed']} computed; "
                f"tokens match: {req['tokens_match']}"
            )
        r = result["ratios"]
        share = with_tp["connector_cpu"]
        print(
            f"prefill of a page x{result['prefill_to_copy']:.1f} its copy; connector CPU "
            f"{100 * share['share_of_step_cpu']:.2f}% of the step's (spread "
            f"{100 * share['spread'][0]:.2f}-{100 * share['spread'][1]:.2f}%)"
        )
        print(
            f"{len(prompts)} requests, TP={args.tp}: prefill computed x{r['prefill_tokens_computed']:.2f}, "
            f"TTFT p50 x{r['ttft_p50']}, requests/s x{r['requests_per_s']:.2f}, tokens identical: {identical}"
        )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
