"""Command-line options built from ServiceConfig's fields, so --help documents every setting
with its environment variable, and the three sources (CLI, TPCACHE_* env, --config file) agree."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from tpcache.service.config import FIELDS, ServiceConfig, build_config, env_name, load_file

CONFIG_JSON_ENV = "TPCACHE_RESOLVED_CONFIG"  # set by `launcher local` for its ranks (all settings)


def add_service_options(parser: argparse.ArgumentParser, overrides: dict[str, Any] | None = None) -> None:
    """One option per ServiceConfig field; ``overrides`` changes the defaults shown (demo)."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML or JSON file of settings (keys as below, without dashes' prefix)"
    )
    group = parser.add_argument_group("service settings (command line > TPCACHE_* environment > --config file)")
    for f in dataclasses.fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-").removesuffix("-s") + ("" if not f.name.endswith("_s") else "")
        default = (overrides or {}).get(f.name, f.default)
        text = f"{f.metadata['help']} [env {env_name(f.name)}; default {default!r}]"
        if f.metadata.get("secret"):
            text = f"{f.metadata['help']} [env {env_name(f.name)}]"
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=type(f.default),
                default=None,
                metavar=type(f.default).__name__.upper(),
                help=text,
            )


def config_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """The merged configuration. ``overrides`` are defaults that sit below the environment."""
    resolved = os.environ.get(CONFIG_JSON_ENV)
    if resolved:
        return build_config(cli=json.loads(resolved), env={})
    file_values = dict(overrides or {})
    if getattr(args, "config", None):
        file_values.update(load_file(args.config))
    cli = {name: getattr(args, name, None) for name in FIELDS}
    return build_config(cli=cli, file_values=file_values)


def resolved_env(config: ServiceConfig) -> dict[str, str]:
    """Environment that hands ``config`` to a rank process unchanged (secret included: the
    environment, unlike a command line, is private to the user)."""
    return {CONFIG_JSON_ENV: json.dumps(dataclasses.asdict(config))}
