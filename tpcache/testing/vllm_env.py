"""The environment vLLM's CPU build needs to run a local random checkpoint offline, at TP=2 on two
cores, with tpcache's connector (set before vLLM is imported)."""

from __future__ import annotations

VLLM_CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one OpenMP thread per TP rank, each on its own core
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # vLLM reserves a core by default; with two there is none to spare
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (worker stats, faults)
}
