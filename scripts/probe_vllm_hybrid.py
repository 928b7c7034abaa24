#!/usr/bin/env python3
"""Which hybrid models vLLM's CPU build runs, without any connector: tiny random checkpoints made on
the spot (transformers' own classes, random weights), one engine at a time in its own process.

    python scripts/probe_vllm_hybrid.py --json            # needs vllm and transformers in this python
    python scripts/probe_vllm_hybrid.py --only gemma2_swa --prefix-caching off

Each model generates greedily for three prompts, one after the other: a prompt, the same prompt
again (a prefix-cache hit), and one that shares only its first 150 tokens. The report says, per
model and prefix-caching setting, whether it ran, the tokens vLLM served from its prefix cache
(``num_cached_tokens``) and the outputs, or the error it stopped with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)


def models() -> dict[str, tuple[str, dict]]:
    """name -> (transformers model class, config keyword arguments)."""
    return {
        "mistral_swa": ("MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=64, head_dim=32)),
        "gemma2_swa": (  # sliding-window and full-attention layers interleaved (Gemma 2 ties embeddings)
            "Gemma2ForCausalLM",
            dict(
                num_hidden_layers=4, sliding_window=64, query_pre_attn_scalar=32, head_dim=32, tie_word_embeddings=True
            ),
        ),
        "qwen2_swa": (
            "Qwen2ForCausalLM",
            dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2),
        ),
        "granite_mamba2": (  # Mamba2 layers interleaved with attention
            "GraniteMoeHybridForCausalLM",
            dict(
                num_hidden_layers=4,
                layer_types=["mamba", "attention", "mamba", "attention"],
                mamba_n_heads=8,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=64,
                num_local_experts=0,
                shared_intermediate_size=256,
                tie_word_embeddings=True,
            ),
        ),
        "jamba_mamba1": (  # Mamba1 layers with one attention layer
            "JambaForCausalLM",
            dict(
                num_hidden_layers=4,
                attn_layer_period=4,
                attn_layer_offset=1,
                expert_layer_period=8,
                num_experts=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
            ),
        ),
    }


def make(name: str, root: Path) -> Path:
    import torch
    import transformers

    cls_name, kwargs = models()[name]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    path = root / name
    cls(config).to(torch.bfloat16).save_pretrained(path)
    return path


def run(path: str, prefix_caching: bool) -> dict:
    """In a child process: build the engine, generate, report (this process never imports vLLM)."""
    os.environ.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    out: dict = {}
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="bfloat16",
            block_size=16,
            max_model_len=1024,
            enable_prefix_caching=prefix_caching,
            seed=0,
            max_num_seqs=4,
        )
        params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
        base = [(i * 37 + 11) % 500 + 3 for i in range(200)]
        out.update(ok=True, cached_tokens=[], outputs=[])
        for prompt in (base + [7, 8, 9], base + [7, 8, 9], base[:150] + [42] * 30):
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0]
            out["cached_tokens"].append(result.num_cached_tokens)
            out["outputs"].append(list(result.outputs[0].token_ids))
    except Exception as exc:  # noqa: BLE001 - the report is what it refused
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=sorted(models()), help="probe only these models")
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per engine")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run(args.child[0], args.child[1] == "on")))
        return 0
    settings = ["on", "off"] if args.prefix_caching == "both" else [args.prefix_caching]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpcache-vllm-probe-") as tmp:
        for name in args.only or sorted(models()):
            path = make(name, Path(tmp))
            for pc in settings:  # one engine at a time, each in its own process
                cmd = [sys.executable, __file__, "--child", str(path), pc]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                    row = json.loads(line[7:]) if line else {"ok": False, "error": proc.stderr[-400:]}
                except subprocess.TimeoutExpired:
                    row = {"ok": False, "error": f"no answer in {args.timeout} s"}
                rows.append({"model": name, "prefix_caching": pc, **row})
    if args.json:
        print(json.dumps({"models": rows}))
    else:
        for r in rows:
            what = f"ran, cached {r['cached_tokens']}" if r["ok"] else f"refused: {r['error']}"
            print(f"{r['model']:16} prefix caching {r['prefix_caching']:3}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
