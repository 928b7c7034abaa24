"""The vLLM ring on CUDA (gpu-marked): the same scenario as test_vllm.py, with vLLM's CUDA build
and its GPU KV layout, at TP=1 (and TP=2 where two GPUs are visible)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm import test_vllm as ring
from tests.vllm.scenario import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_vllm() -> bool:
    probe = "from vllm.platforms import current_platform as p; print(p.is_cuda())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    return out.stdout.strip().endswith("True")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if request.param > torch.cuda.device_count():
        pytest.skip(f"TP={request.param} needs {request.param} GPUs")
    if not _cuda_vllm():
        pytest.fail("a CUDA machine needs vLLM's CUDA build for this test (pip install vllm)")
    # bfloat16, as served: vLLM's FlashAttention backend takes no float32
    out = run(request.param, Path(tmp_path_factory.mktemp(f"vllm_gpu_tp{request.param}")), dtype="bfloat16")
    out["tp"] = request.param
    return out


test_outputs_with_the_connector_equal_plain_vllm = ring.test_outputs_with_the_connector_equal_plain_vllm
test_after_reset_prefix_cache_the_prompts_hit_tpcache = ring.test_after_reset_prefix_cache_the_prompts_hit_tpcache
test_multi_turn_larger_than_vllm_blocks_gets_host_hits = ring.test_multi_turn_larger_than_vllm_blocks_gets_host_hits
test_a_fresh_vllm_on_the_same_storage_gets_storage_hits = ring.test_a_fresh_vllm_on_the_same_storage_gets_storage_hits
test_a_load_failing_on_one_rank_is_recomputed = ring.test_a_load_failing_on_one_rank_is_recomputed
test_requests_aborted_while_loading_release_everything = ring.test_requests_aborted_while_loading_release_everything
test_nothing_stays_held = ring.test_nothing_stays_held
