"""vLLM with tpcache as its host and storage tiers, on CPU, with a small random model made here.

    .venv/bin/python examples/vllm_tpcache.py --tp 2 --storage-dir /tmp/tpcache-kv

Runs a batch of prompts that share a prefix, empties vLLM's own prefix cache, runs them again
(the prefix now comes from tpcache's host tier), and prints, per batch, the cached tokens of each
prompt and vLLM's own count of cached tokens by where they came from: vLLM's prefix cache, tpcache's
host tier, tpcache's storage tier (``vllm:prompt_tokens_cached_by_source``). Run it a second time
with the same --storage-dir: the first batch then hits tpcache's storage tier.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of vLLM's own KV blocks
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


SOURCES = {"device": "vLLM prefix cache", "host": "tpcache host", "disk": "tpcache storage"}


def cached_by_source(llm: Any) -> dict[str, int]:
    """vLLM's counter of cached prompt tokens by the tier that supplied them, so far."""
    counts = dict.fromkeys(SOURCES.values(), 0)
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source" and metric.labels.get("source") in SOURCES:
            counts[SOURCES[metric.labels["source"]]] += int(metric.value)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (one tpcache rank per worker)")
    ap.add_argument("--storage-dir", default="", help="tpcache's storage tier (L3); empty: host tier only")
    ap.add_argument("--host-pages", type=int, default=0, help="host pages per rank; 0: sized from free memory")
    ap.add_argument(
        "--model-dir",
        default=str(Path(tempfile.gettempdir()) / "tpcache-example-model"),
        help="where the random model is written (a stored page belongs to one model: keep it across runs)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))

    from vllm import LLM, SamplingParams

    from tpcache.testing.tiny_model import make_tiny_llama

    # A fixed seed and path: a second run has the same model, so its pages in storage still match.
    model = make_tiny_llama(args.model_dir, num_layers=2, head_dim=32, seed=0)
    extra = {"host_pages": args.host_pages, "storage_dir": args.storage_dir}
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=32,
        max_model_len=1024,
        tensor_parallel_size=args.tp,
        disable_log_stats=False,  # vLLM's metrics, read back below
        kv_transfer_config={
            "kv_connector": "TPCacheConnector",
            "kv_connector_module_path": "tpcache.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {k: v for k, v in extra.items() if v},
        },
    )
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(256)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(3, 500) for _ in range(40)]} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)

    def run(name: str) -> list[list[int]]:
        before = cached_by_source(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        after = cached_by_source(llm)
        per_prompt = [out.num_cached_tokens for out in outputs]
        sources = ", ".join(f"{k} {after[k] - before[k]}" for k in after)
        print(f"{name}: cached tokens per prompt {per_prompt}; by source: {sources}", flush=True)
        return [list(out.outputs[0].token_ids) for out in outputs]

    first = run("first batch")
    llm.reset_prefix_cache()  # vLLM forgets its blocks; tpcache keeps its pages
    again = run("after reset_prefix_cache")
    print(f"same tokens both times: {first == again}", flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps it from running this again
    main()
