"""The launcher: its options, configuration sources, torchrun, the demo and the embedded example."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.__main__ import build_parser
from launcher.local import free_port
from tests.service.checks import cache_round_trip
from tests.service.harness import REPO, pid_alive, repo_env, running_service
from tpcache.service.config import ConfigError, ServiceConfig, build_config, env_name


def test_help_explains_every_option() -> None:
    for command in ("serve", "local", "demo"):
        parser = build_parser()
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        text = sub.format_help()
        for f in dataclasses.fields(ServiceConfig):
            assert env_name(f.name) in text, (command, f.name)
    assert build_parser().parse_args(["demo", "--trace", "t.jsonl"]).trace == "t.jsonl"


def test_config_sources_and_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[tpcache]\npage_size = 32\nhost_pages = 100\ndevice_pages = 10\n")
    env = {"TPCACHE_HOST_PAGES": "200", "TPCACHE_MIRROR_RELEASE": "false"}
    from tpcache.service.config import load_file

    config = build_config(cli={"device_pages": 20}, env=env, file_values=load_file(toml))
    assert (config.page_size, config.host_pages, config.device_pages, config.mirror_release) == (32, 200, 20, False)
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"round_timeout_s": 5}))
    assert build_config(env={}, file_values=load_file(js)).round_timeout_s == 5.0
    with pytest.raises(ConfigError, match="TPCACHE_PAGE_SIZE=many: must be an integer"):
        build_config(env={"TPCACHE_PAGE_SIZE": "many"})
    with pytest.raises(ConfigError, match="unknown setting"):
        build_config(env={}, file_values={"pagesize": 3})
    with pytest.raises(ConfigError, match="--write-policy sometimes: must be one of"):
        build_config(env={}, cli={"write_policy": "sometimes"})


@pytest.mark.multiprocess
def test_torchrun_serve(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    port = str(free_port())
    command += [
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        "-m",
        "launcher",
        "serve",
        "--page-size",
        "4",
        "--log-level",
        "INFO",
    ]
    with running_service(tmp_path, command=command) as service:
        cache_round_trip(service)
        pids = service.pids
        service.stop()  # torchrun itself exits 1 on a death signal; its workers must stop cleanly
        log = service.log()
        assert log.count("signal 15: stopping") == 2 and "SIGKILL" not in log, log
        assert not any(pid_alive(pid) for pid in pids)


def run_demo(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``launcher demo ARGS --json``, which must succeed: the process and its summary (stdout holds
    the JSON object and nothing else)."""
    run = subprocess.run(
        [sys.executable, "-m", "launcher", "demo", *args, "--json"],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run, json.loads(run.stdout)


@pytest.mark.multiprocess
def test_demo_runs_end_to_end() -> None:
    _, summary = run_demo("--conversations", "12")
    assert summary["digests_equal"] is True and len(set(summary["digests"])) == 1
    assert summary["requests"] > 0 and 0 < summary["hit_rate"] < 1
    assert summary["rounds"] > 0 and summary["round_latency_us_p50"] > 0
    assert summary["exit_codes"] == [0, 0] and summary["health"] == "open"
    assert summary["hit_rate"] <= summary["unbounded_hit_rate"] <= 1
    assert summary["pool_tokens"] == {"device": 2048 * 16, "host": 8192 * 16}


@pytest.mark.multiprocess
def test_demo_pipelined_mode_says_what_it_measured() -> None:
    from launcher.demo import format_summary

    _, summary = run_demo("--conversations", "4", "--in-flight", "4")
    assert summary["in_flight"] == 4 and summary["requests"] > 4
    assert summary["digests_equal"] is True and summary["exit_codes"] == [0, 0] and summary["health"] == "open"
    assert 0 < summary["hit_rate"] <= summary["unbounded_hit_rate"] <= 1
    assert summary["calls_per_s"] > summary["requests_per_s"] > 0  # every request makes several calls
    text = format_summary(summary)
    assert "pipelined, 4 requests in flight" in text and "one call at a time" not in text
    sequential = format_summary({**summary, "in_flight": 1})
    assert "one call at a time" in sequential and "--in-flight" in sequential
    refused = format_summary({**summary, "refused_pages": 12345})
    assert "12,345 pages refused" in refused


def test_demo_in_flight_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from launcher.__main__ import main

    assert main(["demo", "--in-flight", "0"]) == 2  # refused before any rank starts
    assert "--in-flight 0: must be an integer >= 1" in capsys.readouterr().err
