"""Settings: one name per setting in every source, every value checked with a one-line error that
names the setting as its source spells it, sizes and the KV layout written one way, and the
machine checks (ports, storage directory, memory) made before any rank starts."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from launcher.__main__ import build_parser, main
from launcher.options import config_from_args
from tpcache.service.config import (
    FIELDS,
    ConfigError,
    Resolved,
    ServiceConfig,
    describe_sources,
    env_name,
    flag_name,
    format_bytes,
    format_kv_layout,
    load_file,
    parse_kv_layout,
    parse_size,
    resolve,
)
from tpcache.service.preflight import check_memory, preflight


def test_one_name_per_setting_in_every_source(tmp_path: Path) -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for f in dataclasses.fields(ServiceConfig):
        assert flag_name(f.name) == "--" + f.name.replace("_", "-")
        assert env_name(f.name) == "TPCACHE_" + f.name.upper()
        assert flag_name(f.name) in help_text and env_name(f.name) in help_text
    assert "--round-timeout-s" in help_text and "--heartbeat-s" in help_text
    # The same value from each source, under the same name.
    (tmp_path / "c.toml").write_text("round_timeout_s = 7.5\n")
    for kwargs in (
        {"cli": {"round_timeout_s": "7.5"}, "env": {}},
        {"env": {"TPCACHE_ROUND_TIMEOUT_S": "7.5"}},
        {"env": {}, "file": tmp_path / "c.toml"},
    ):
        assert resolve(**kwargs).config.round_timeout_s == 7.5  # type: ignore[arg-type]


def test_precedence_and_sources_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tpcache:\n  page_size: 32\n  host_pages: 100\n  device_pages: 10\n")
    env = {"TPCACHE_HOST_PAGES": "200"}
    resolved = resolve(cli={"device_pages": "20"}, env=env, file=path)
    config = resolved.config
    assert (config.page_size, config.host_pages, config.device_pages) == (32, 200, 20)
    assert resolved.sources["device_pages"] == "command line"
    assert resolved.sources["host_pages"] == "environment"
    assert resolved.sources["page_size"] == f"file {path}"
    assert resolved.sources["max_batch"] == "default"
    lines = describe_sources(resolved)
    assert lines[0] == "(command line) device_pages=20" and lines[1] == "(environment) host_pages=200"
    assert lines[2] == f"(file {path}) page_size=32" and lines[-1].startswith("(default) endpoint=")


@pytest.mark.parametrize(
    ("cli", "env", "message"),
    [
        ({"device_pages": "0"}, {}, "--device-pages 0: must be an integer >= 1"),
        ({}, {"TPCACHE_DEVICE_PAGES": "0"}, "TPCACHE_DEVICE_PAGES=0: must be an integer >= 1"),
        ({"eviction_policy": "arc"}, {}, "--eviction-policy arc: must be one of lru, lfu, fifo"),
        ({"log_level": "verbose"}, {}, "--log-level verbose: must be one of DEBUG, INFO, WARNING, ERROR"),
        ({"write_policy": "sometimes"}, {}, "--write-policy sometimes: must be one of none, write_through"),
        ({"transport": "carrier-pigeon"}, {}, "--transport carrier-pigeon: must be one of auto, shm, torch"),
        ({"page_size": "many"}, {}, "--page-size many: must be an integer"),
        ({"round_timeout_s": "0"}, {}, "--round-timeout-s 0.0: must be a number >= 0.001"),
        ({"metrics_port": "70000"}, {}, "--metrics-port 70000: must be an integer in [0, 65535]"),
        ({"retention_cap_tokens": "-2"}, {}, "--retention-cap-tokens -2: must be an integer >= -1"),
        ({"storage_bytes": "lots"}, {}, "--storage-bytes lots: must be a size in bytes"),
        ({"kv_layout": "layers=2,heads=2"}, {}, "--kv-layout layers=2,heads=2: must be L<layers>xH<kv heads"),
        ({"kv_layout": "L2xH2xD4:complex64"}, {}, "--kv-layout L2xH2xD4:complex64: KV dtype"),
        ({"storage_dir": "/tmp/x"}, {}, "--storage-dir /tmp/x: needs kv_layout"),
        ({"endpoint": "tcp://0.0.0.0:5555"}, {}, "--endpoint tcp://0.0.0.0:5555: is not a loopback address"),
        (
            {},
            {"TPCACHE_ROUND_TIMEOUT": "3"},
            "environment variable TPCACHE_ROUND_TIMEOUT is not a tpcache setting; did you mean TPCACHE_ROUND_TIMEOUT_S",
        ),
        (
            {},
            {"TPCACHE_NOT_A_THING": "3"},
            "environment variable TPCACHE_NOT_A_THING is not a tpcache setting (python -m launcher",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_setting_value_and_what_is_allowed(
    cli: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(cli=cli, env=env)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_lower_case_log_levels_and_internal_variables_are_accepted() -> None:
    env = {"TPCACHE_NO_FUTEX": "1", "TPCACHE_FAULT_DROP_BATCH": "3", "TPCACHE_LOG_LEVEL": "debug"}
    assert resolve(env=env).config.log_level == "DEBUG"


def test_config_files_name_themselves_in_errors_and_suggest_the_nearest_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("round_timeout = 3\n")
    with pytest.raises(
        ConfigError, match=rf"config file {path}: unknown setting 'round_timeout'; did you mean round_timeout_s\?"
    ):
        load_file(path)
    path.write_text("page-size = 3\n")
    with pytest.raises(ConfigError, match="did you mean page_size"):
        load_file(path)
    path.write_text("device_pages = 0\n")
    with pytest.raises(ConfigError, match=rf"^device_pages = 0 in {path}: must be an integer >= 1"):
        resolve(env={}, file=path)
    yaml = tmp_path / "c.yml"
    yaml.write_text("page_size: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"config file {yaml} is not valid YML"):
        load_file(yaml)
    (tmp_path / "c.json").write_text('{"storage_bytes": "2GiB", "kv_layout": "L2xH2xD4:bf16"}')
    assert load_file(tmp_path / "c.json") == {"storage_bytes": "2GiB", "kv_layout": "L2xH2xD4:bf16"}
    with pytest.raises(ConfigError, match=r"unknown format '.ini'; use .toml, .json, .yaml, .yml"):
        load_file(tmp_path / "c.ini")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_file(tmp_path / "absent.yaml")


def test_sizes_take_units() -> None:
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("1.5 TB") == 1_500_000_000_000
    assert parse_size("512") == parse_size(512) == 512
    assert parse_size("4kib") == 4096
    for bad in ("64 GB of it", "GiB", "-1", "1e9", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert resolve(cli={"storage_bytes": "64GiB"}, env={}).config.storage_bytes == 64 << 30
    assert format_bytes(64 << 30) == "64 GiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(7) == "7 B"


def test_one_kv_layout_syntax_parsed_and_printed_the_same_way() -> None:
    for text in ("L32xH8xD128:bf16", "L2xH2xD4:fp32", "L1xH1xD8:fp16", "L4xH2xD64:float64"):
        assert format_kv_layout(parse_kv_layout(text, 16)) == text
    layout = parse_kv_layout("L32xH8xD128:bfloat16", 16)
    assert format_kv_layout(layout) == "L32xH8xD128:bf16"
    assert layout.page_bytes == 32 * 2 * 16 * 8 * 128 * 2


def test_the_rank_hand_over_keeps_values_and_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.options import resolved_env

    resolved = resolve(cli={"device_pages": "20", "storage_bytes": "1MiB"}, env={"TPCACHE_HOST_PAGES": "8"})
    monkeypatch.setenv(*next(iter(resolved_env(resolved).items())))
    again = config_from_args(build_parser().parse_args(["serve"]))
    assert again == resolved


def test_settings_that_may_differ_between_ranks_are_exactly_the_local_ones() -> None:
    shared = ServiceConfig().group_settings()
    local = {
        "endpoint",
        "allow_remote",
        "secret",
        "internal_host",
        "storage_dir",
        "storage_url",
        "storage_key",  # a secret: never sent between ranks (each reads its own)
        "storage_key_file",
        "metrics_port",
        "ready_file",
        "events_endpoint",
        "events_replay_endpoint",
        "tree_core",  # both cores make the same decisions: a host without a compiler may run the reference
    }
    assert set(FIELDS) - set(shared) == local | {"log_level"}
    assert "secret" not in shared and shared["storage"] is False


def test_memory_the_pools_need_is_checked_with_sizes_in_the_message() -> None:
    resolved = resolve(cli={"kv_layout": "L32xH8xD128:bf16", "device_pages": "1024", "host_pages": "4096"}, env={})
    check_memory(resolved, 2, available=20 << 30)  # 2 x 5 GiB fits in 20 GiB
    with pytest.raises(ConfigError) as info:
        check_memory(resolved, 2, available=8 << 30)
    text = str(info.value)
    assert "2 rank(s) on this host x (device tier 1,024 pages + host tier 4,096 pages) x 2 MiB a page" in text
    assert "= 20 GiB, but this machine has 8 GiB available" in text
    with pytest.raises(ConfigError, match=r"x \(host tier 4,096 pages\) x 2 MiB a page .* = 16 GiB"):
        check_memory(resolved, 2, available=8 << 30, device_on_host=False)  # the device tier is on a GPU
    check_memory(resolve(env={}), 2, available=0)  # metadata only: no KV bytes


def test_busy_ports_and_unwritable_directories_are_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        metrics = resolve(cli={"metrics_port": str(port - 1)}, env={})
        preflight(metrics, range(1), 1)  # rank 0 alone: port - 1 only
        with pytest.raises(ConfigError, match=rf"--metrics-port {port - 1}: port {port} \(rank 1's metrics"):
            preflight(metrics, range(2), 2)
        endpoint = resolve(cli={"endpoint": f"tcp://127.0.0.1:{port}"}, env={})
        with pytest.raises(ConfigError, match=rf"--endpoint tcp://127.0.0.1:{port}: cannot bind port {port}"):
            preflight(endpoint, range(2), 2)
        events = resolve(cli={"events_endpoint": f"tcp://127.0.0.1:{port}"}, env={})
        with pytest.raises(ConfigError, match=rf"--events-endpoint tcp://127.0.0.1:{port}: cannot bind port {port}"):
            preflight(events, range(1), 1)
        preflight(events, range(1, 2), 2)  # rank 0 binds it, not rank 1
        replay = resolve(cli={"events_endpoint": f"tcp://127.0.0.1:{port - 1}"}, env={})  # replay on the port + 1
        with pytest.raises(
            ConfigError, match=rf"--events-endpoint tcp://127.0.0.1:{port - 1}: cannot bind port {port} "
        ):
            preflight(replay, range(1), 1)
        cli = {"events_endpoint": "0", "events_replay_endpoint": str(port)}
        with pytest.raises(ConfigError, match=rf"--events-replay-endpoint {port}: cannot bind port {port}"):
            preflight(resolve(cli=cli, env={}), range(1), 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    storage = resolve(cli={"storage_dir": str(blocker / "kv"), "kv_layout": "L2xH2xD4:bf16", "host_pages": "8"}, env={})
    with pytest.raises(ConfigError, match=rf"--storage-dir {blocker / 'kv'}: cannot write the storage tier there"):
        preflight(storage, range(2), 2)
    ok = resolve(cli={"storage_dir": str(tmp_path / "kv"), "kv_layout": "L2xH2xD4:bf16", "host_pages": "8"}, env={})
    preflight(ok, range(2), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # checked, not created: the ranks create it
    ready = resolve(cli={"ready_file": str(tmp_path / "absent" / "ready.json")}, env={})
    with pytest.raises(ConfigError, match="its directory .* does not exist or is not writable"):
        preflight(ready, range(1), 1)


def test_the_model_layout_checks_its_own_directory(tmp_path: Path) -> None:
    from tpcache.io.storage.file import FileBackend

    def model_layout(storage_dir: Path) -> Resolved:
        cli = {"storage_dir": str(storage_dir), "model_id": "m", "model_layout": "L2xH4xD4:bf16", "host_pages": "8"}
        return resolve(cli=cli, env={})

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model").write_text("")  # where the model layout writes
    with pytest.raises(ConfigError, match="cannot write the storage tier there .*it is not a directory"):
        preflight(model_layout(tmp_path / "bad"), range(2), 2)
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "rank0").write_text("")  # the per-rank layout's place: not the model layout's
    # Another group of the same shape writes there: this one takes the next of each shard's directories.
    running = FileBackend(tmp_path / "kv" / "model", capacity_bytes=1 << 20, owner="r0of2")
    try:
        preflight(model_layout(tmp_path / "kv"), range(2), 2)
    finally:
        running.close()


def test_the_launcher_refuses_bad_settings_before_starting_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--nproc", "2", "--device-pages", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "tpcache: configuration error: --device-pages 0: must be an integer >= 1 (pages in the device tier (L1))\n"
    )
    assert main(["local", "--nproc", "0"]) == 2
    assert "--nproc 0: must be an integer >= 1" in capsys.readouterr().err


def test_a_pp_x_tp_group_is_checked_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    model = ["--model-layout", "L32xH8xD128:bf16"]
    cases = [
        (
            ["--nproc", "3", "--pp-size", "2", "--tp-size", "2"],
            "--tp-size 2: PP2xTP2 needs 4 ranks, but the world size is 3",
        ),
        (
            ["--nproc", "6", "--pp-size", "4"],
            "--pp-size 4: 6 ranks cannot form 4 pipeline stage(s) x 1 context rank(s)",
        ),
        (
            ["--pp-size", "3", "--tp-size", "2", *model],
            "--model-layout L32xH8xD128:bf16: 32 layers cannot be split evenly",
        ),
        (
            ["--pp-size", "2", "--tp-size", "3", *model],
            "--model-layout L32xH8xD128:bf16: 8 KV heads cannot be split evenly",
        ),
        (
            ["--kv-layout", "L2xH2xD4:bf16", "--model-layout", "L4xH4xD4:bf16"],
            "--model-layout L4xH4xD4:bf16: give kv_layout",
        ),
        (
            ["--kv-layout", "L2xH2xD4:bf16", "--model-id", "llama"],
            "--model-id llama: needs model_layout",
        ),
        (
            ["--pp-size", "3", "--tp-size", "1", "--model-layout", "L12xH8xD128:bf16", "--model-id", "m"],
            "--model-layout L12xH8xD128:bf16: PP3xTP1 gives each rank 4 layer(s) x 8 KV head(s), which splits",
        ),
    ]
    for argv, message in cases:
        assert main(["local", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tpcache: configuration error: {message}"), err
        assert err.count("\n") == 1


def test_each_rank_of_a_group_holds_its_slice_of_the_model_layout() -> None:
    resolved = resolve(cli={"model_layout": "L32xH8xD128:bf16", "pp_size": "2", "tp_size": "2"}, env={})
    config = resolved.config
    assert config.group(4).name == "PP2xTP2"
    assert format_kv_layout(config.rank_layout(4)) == "L16xH4xD128:bf16"  # 512 KiB a page, not the model's 2 MiB
    with pytest.raises(ConfigError, match=r"x 512 KiB a page \(L32xH8xD128:bf16 over the group\) = 8 GiB"):
        check_memory(resolved, 4, available=1 << 30, world=4)
    plain = resolve(cli={"model_layout": "L32xH8xD128:bf16"}, env={}).config
    assert plain.group(8).name == "PP1xTP8" and format_kv_layout(plain.rank_layout(8)) == "L32xH1xD128:bf16"
    assert {"pp_size", "tp_size", "model_layout"} <= set(config.group_settings())  # equal on every rank


def test_host_mode_has_one_name_is_checked_before_start_and_must_match_across_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--host-mode buffer: needs a storage tier"):
        resolve(cli={"host_mode": "buffer"}, env={})
    with pytest.raises(ConfigError, match=r"^TPCACHE_HOST_MODE=mirror: must be one of cache, buffer"):
        resolve(env={"TPCACHE_HOST_MODE": "mirror"})
    store = {"storage_dir": str(tmp_path), "kv_layout": "L2xH1xD8:bf16"}
    with pytest.raises(ConfigError, match="needs host_pages >= 1"):
        resolve(cli={"host_mode": "buffer", **store}, env={})
    (tmp_path / "c.toml").write_text('host_mode = "buffer"\nhost_pages = 8\n')
    config = resolve(cli=store, env={}, file=tmp_path / "c.toml").config
    assert config.cache_config().host_mode == "buffer"
    assert config.group_settings()["host_mode"] == "buffer"  # ranks that differ stop together at start
