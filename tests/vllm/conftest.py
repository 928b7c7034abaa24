"""The vLLM ring's driver runs, one per xdist group, so that the two workers share the ring.

Each run is session-scoped: its group's tests, in test_vllm.py and test_vllm_swa.py, read their
part of it, and it runs once per worker whatever order the tests come in. A test run on its own
still runs its whole group (a few engines more than it reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.scenario import Results, cross_tp_plan, gemma_plan, llama_plan, mistral_plan, run_suite

# Every TP=1 engine in one driver, the TP=2 engines (a worker process per rank) in the other.
TP1_GROUP = "vllm_tp1"
TP2_GROUP = "vllm_tp2"


@pytest.fixture(scope="session")
def vllm_tp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Results]:
    workdir = Path(tmp_path_factory.mktemp("vllm_tp1"))
    plans = {
        "llama": llama_plan(1, workdir / "llama"),
        "gemma": gemma_plan(workdir / "gemma"),
        "mistral": mistral_plan(workdir / "mistral"),
    }
    return run_suite(plans, workdir)


@pytest.fixture(scope="session")
def vllm_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Results]:
    workdir = Path(tmp_path_factory.mktemp("vllm_tp2"))
    return run_suite({"llama": llama_plan(2, workdir / "llama"), "gemma": gemma_plan(workdir / "gemma", 2)}, workdir)


@pytest.fixture(scope="session")
def vllm_cross_tp(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """TP=2 and TP=1 engines on one storage directory (``scenario.cross_tp_plan``), in the TP=2
    group's worker, in a driver run of its own."""
    workdir = Path(tmp_path_factory.mktemp("vllm_cross_tp"))
    return run_suite({"cross": cross_tp_plan(workdir / "cross")}, workdir)["cross"]
