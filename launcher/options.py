"""Command-line options built from ServiceConfig's fields, so --help documents every setting
with its environment variable, and the three sources (CLI, TPCACHE_* env, --config file) use one
name per setting: ``--round-timeout-s``, ``TPCACHE_ROUND_TIMEOUT_S``, ``round_timeout_s``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from tpcache.core import backend
from tpcache.service.config import (
    FIELDS,
    RESOLVED_ENV,
    Resolved,
    ServiceConfig,
    env_name,
    flag_name,
    format_bytes,
    resolve,
)

DEMO_SOURCE = "demo default"


def add_service_options(parser: argparse.ArgumentParser, overrides: dict[str, Any] | None = None) -> None:
    """One option per ServiceConfig field; ``overrides`` changes the defaults shown (demo)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML, JSON or YAML file of settings, by extension; keys are the settings' names (round_timeout_s)",
    )
    group = parser.add_argument_group(
        "service settings (command line > TPCACHE_* environment > --config file > defaults)"
    )
    for f in dataclasses.fields(ServiceConfig):
        default = (overrides or {}).get(f.name, f.default)
        shown = format_bytes(default) if f.metadata.get("unit") == "bytes" else repr(default)
        text = f"{f.metadata['help']} [env {env_name(f.name)}; default {shown}]"
        if f.metadata.get("secret"):
            text = f"{f.metadata['help']} [env {env_name(f.name)}]"
        if isinstance(f.default, bool):
            group.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
            continue
        # Values stay strings here: the config coerces and checks every source alike, so a bad
        # value on the command line reads like one in the environment or a file.
        metavar = {int: "N", float: "SECONDS" if f.name.endswith("_s") else "X", str: "TEXT"}[type(f.default)]
        if f.metadata.get("unit") == "bytes":
            metavar = "SIZE"
        elif "metavar" in f.metadata:
            metavar = f.metadata["metavar"]
        elif "choices" in f.metadata:
            metavar = "{" + ",".join(f.metadata["choices"]) + "}"
        group.add_argument(flag_name(f.name), dest=f.name, default=None, metavar=metavar, help=text)


def config_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> Resolved:
    """The merged, checked configuration and where each value came from. A rank started by
    ``launcher local`` takes its launcher's resolved configuration unchanged."""
    handed_over = os.environ.get(RESOLVED_ENV)
    if handed_over:
        return Resolved.from_json(handed_over)
    cli = {name: getattr(args, name, None) for name in FIELDS}
    return resolve(cli=cli, file=getattr(args, "config", None) or None, defaults=overrides, defaults_source=DEMO_SOURCE)


def resolved_env(resolved: Resolved) -> dict[str, str]:
    """Environment that hands ``resolved`` to a rank process unchanged (secret included: the
    environment, unlike a command line, is private to the user)."""
    return {RESOLVED_ENV: resolved.to_json(), backend.ENV: resolved.config.tree_core}
