"""tpcache launcher.

    torchrun --nproc-per-node N -m launcher serve [options]   one rank per process (torchrun env)
    python -m launcher local --nproc N [options]              N ranks on this host, no torchrun
    python -m launcher local --pp-size P --tp-size T [options]  a group of P stages x T tensor ranks
    python -m launcher demo [--trace PATH] [--nproc 2] [--in-flight N] [--json]   the main job, end to end

Every option can also come from the environment (TPCACHE_<NAME>) or a --config TOML, JSON or
YAML file, under one name: --round-timeout-s, TPCACHE_ROUND_TIMEOUT_S, round_timeout_s.
Settings are checked before any rank starts; a bad one exits with code 2 and one line naming it.
A problem found once the ranks run (a storage directory in use, a store that cannot be reached)
stops every rank alike: one line naming the setting and the cause, exit code 2 (the traceback
only with --log-level DEBUG).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from launcher.demo import DEMO_DEFAULTS, Interrupted, print_result, run_demo
from launcher.local import RankExited, run_local
from launcher.options import add_service_options, config_from_args
from tpcache.core import backend
from tpcache.service.config import DEFAULT, ConfigError, Resolved, spelling
from tpcache.service.preflight import preflight


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,local,demo}")
    serve = sub.add_parser("serve", help="run one rank (under torchrun, or with RANK/WORLD_SIZE/MASTER_* set)")
    add_service_options(serve)
    local = sub.add_parser("local", help="run N ranks on this host without torchrun (gloo on CPU)")
    local.add_argument(
        "--nproc", type=int, default=None, help="number of rank processes [default: pp_size x tp_size, or 2]"
    )
    add_service_options(local)
    demo = sub.add_parser("demo", help="start a local service, replay a workload through it, print a summary")
    demo.add_argument("--trace", metavar="PATH", help="Mooncake-format trace (JSON lines); default: built-in workload")
    demo.add_argument(
        "--nproc", type=int, default=None, help="number of rank processes [default: pp_size x tp_size, or 2]"
    )
    demo.add_argument("--conversations", type=int, default=100, help="built-in workload size [default 100]")
    demo.add_argument("--requests", type=int, default=None, help="replay at most this many requests")
    demo.add_argument("--seed", type=int, default=0, help="built-in workload seed [default 0]")
    demo.add_argument(
        "--in-flight",
        type=int,
        default=1,
        metavar="N",
        help="requests in flight: 1 sends one call at a time; N > 1 replays in pipelined waves of N [default 1]",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_service_options(demo, DEMO_DEFAULTS)
    return parser


def choose_tree_core(resolved: Resolved, command: str, restart: bool) -> None:
    """Make the tree core the settings name the one this process and its ranks run. The core is
    chosen when tpcache is first imported (``TPCACHE_TREE_CORE``), before a command line or a
    config file is read: ranks the launcher starts (``local``, ``demo``) inherit the variable; a
    rank run from the shell (``serve``) starts again with it set."""
    value = resolved.config.tree_core
    if value == backend.NAME:
        return
    if command != "serve":
        os.environ[backend.ENV] = value
        return
    if restart and os.environ.get(backend.ENV) != value:
        os.environ[backend.ENV] = value
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    raise ConfigError(
        f"{spelling('tree_core', value, resolved.sources.get('tree_core', DEFAULT))}: this process runs the "
        f"{backend.NAME} tree core, chosen when tpcache was imported; set {backend.ENV}={value} in its environment"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolved = config_from_args(args, DEMO_DEFAULTS if args.command == "demo" else None)
        if args.command in ("local", "demo"):
            if args.nproc is None:
                config = resolved.config
                args.nproc = config.pp_size * config.tp_size if config.tp_size else 2
            if args.nproc < 1:
                raise ConfigError(f"--nproc {args.nproc}: must be an integer >= 1 (rank processes)")
            if args.command == "demo" and args.in_flight < 1:
                raise ConfigError(f"--in-flight {args.in_flight}: must be an integer >= 1 (requests in flight)")
            preflight(resolved, range(args.nproc), args.nproc)  # every rank, before any starts
        choose_tree_core(resolved, args.command, restart=argv is None)
    except ConfigError as exc:
        print(f"tpcache: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from tpcache.service.process import serve

        code = serve(resolved)
        # Everything the rank owns is closed by now; skip the interpreter's slow torch teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if args.command == "local":
        return run_local(resolved, args.nproc)
    try:
        summary = run_demo(
            resolved, args.nproc, args.trace, args.conversations, args.requests, args.seed, args.in_flight
        )
    except ConfigError as exc:
        print(f"tpcache: configuration error: {exc}", file=sys.stderr)
        return 2
    except RankExited as exc:
        if exc.code != 2:  # 2: rank 0 has printed the line that says why the group did not start
            print(f"tpcache demo: {exc}", file=sys.stderr)
        return exc.code if exc.code > 0 else 1
    except Interrupted as stopped:
        print(stopped.line(), file=sys.stderr, flush=True)
        return {signal.SIGINT: 130, signal.SIGTERM: 0}.get(stopped.signum, 1)
    print_result(summary, args.json)
    return 0 if summary["digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
