"""Scenarios that real rank processes can run by name (``group.run_group``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

SCENARIOS: dict[str, Callable[..., Any]] = {}


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank_rng(seed: int, rank: int) -> random.Random:
    return random.Random(f"{seed}/{rank}")
