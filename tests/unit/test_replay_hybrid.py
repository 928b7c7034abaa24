"""Trace replay of hybrid models: the hit rule's effect on the hit rate, and what each component holds."""

import json
import subprocess
import sys
from dataclasses import replace

from tests.conftest import REPO
from tpcache.replay import config_for_tokens, replay
from tpcache.workload import SyntheticWorkload

PAGE = 512


def requests():
    return list(SyntheticWorkload(seed=7, conversations=40).requests())


def test_with_room_for_everything_a_component_kept_on_every_page_changes_no_hit():
    reqs = requests()
    full, _ = replay(reqs, config_for_tokens(None, PAGE, write_policy="none"))
    base = config_for_tokens(None, PAGE, write_policy="none")
    swa = replace(base, swa_window=4096, swa_device_pages=base.device_pages, swa_release_out_of_window=False)
    mamba = replace(base, mamba_every=1, mamba_device_states=base.device_pages)
    for config in (swa, mamba):
        result, core = replay(reqs, config)
        assert result.hit_tokens == full.hit_tokens
        assert result.held is not None and result.held["full"] == core.device.used


def test_states_every_k_pages_cut_hits_to_those_boundaries():
    reqs = requests()
    base = config_for_tokens(None, PAGE, write_policy="none")
    full, _ = replay(reqs, base)
    every4, core = replay(reqs, replace(base, mamba_every=4, mamba_device_states=base.device_pages))
    assert 0 < every4.hit_tokens < full.hit_tokens
    assert every4.hit_tokens % (4 * PAGE) == 0  # every hit ends at a state
    assert every4.held["mamba"] == sum(1 for n in core.tree.nodes.values() if n.depth and n.depth % 4 == 0)


def test_out_of_window_release_holds_fewer_swa_pages_and_is_deterministic():
    reqs = requests()
    base = config_for_tokens(64 * PAGE, PAGE, write_policy="none")
    keep = replace(base, swa_window=1024, swa_device_pages=64, swa_release_out_of_window=False)
    kept, _ = replay(reqs, keep)
    freed, _ = replay(reqs, replace(keep, swa_release_out_of_window=True))
    again, _ = replay(reqs, replace(keep, swa_release_out_of_window=True))
    assert freed.mean_held["swa"] < kept.mean_held["swa"]
    assert (freed.hit_tokens, freed.digest) == (again.hit_tokens, again.digest)


def test_replay_script_reports_each_components_pages():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "replay.py"), "--conversations", "20", "--device-tokens", "32768"]
        + ["--swa-window", "1024", "--mamba-every", "2", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    d = json.loads(out.stdout)
    assert set(d["held"]) == {"full", "swa", "mamba"} and set(d["mean_held"]) == set(d["held"])
    assert (d["swa_window"], d["mamba_every"]) == (1024, 2)
