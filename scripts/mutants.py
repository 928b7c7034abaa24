"""Mutation check of the fast rings: each mutant breaks one consistency promise; the rings must fail.

Copies the tracked tree (and built extensions) into a temporary directory per mutant, applies one
textual change there, and runs ``pytest -x tests/treecore tests/unit tests/sim`` on the copy. A mutant that
survives is a promise no fast test holds.

A mutant of a Python file runs the rings on the ``reference`` tree core (``TPCACHE_TREE_CORE``), so
the mutated Python is what runs where the native core has the same code in C; ``--tree-core``
chooses another (``native``: what the C path alone catches). A mutant of a native source rebuilds
the copy's extensions and runs the rings on the ``native`` core.

    python scripts/mutants.py            # every mutant
    python scripts/mutants.py --only 3   # one of them
    python scripts/mutants.py --rings tests/sim --json   # what the simulator alone catches
    python scripts/mutants.py --tree-core native         # the rings on the native core
    python scripts/mutants.py --baseline                 # first: the rings pass without a mutant
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (what it breaks, file, text, replacement)
# The test that each mutant still finds its text (which every mutated copy fails by design).
SELF_CHECK = "tests/unit/test_mutants.py"

MUTANTS: list[tuple[str, str, str, str]] = [
    (
        "completions applied although queue digests differ",
        "tpcache/core/round.py",
        '            self._close(f"{QUEUE_OF[kind]} queues differ across ranks", report)\n            return\n',
        '            self._close(f"{QUEUE_OF[kind]} queues differ across ranks", report)\n',
    ),
    (
        "device page left out of the state digest",
        "tpcache/core/treecore/accounting.py",
        "        node.device_page,\n",
        "0,\n",
    ),
    ("hits left out of the state digest", "tpcache/core/treecore/accounting.py", "        node.hits,\n", "0,\n"),
    (
        "host slot left out of the state digest",
        "tpcache/core/treecore/accounting.py",
        "        node.host_slot,\n",
        "0,\n",
    ),
    (
        "insert adopts pages below a page still loading",
        "tpcache/core/inserts.py",
        "            if state == DeviceState.LOADING:\n                loading = True\n                break\n",
        "",
    ),
    (
        "LRU tie-break takes the shallowest page",
        "tpcache/core/treecore/candidates.py",
        "        return node.last_access << 128 | (_DEPTH - node.depth) << 64 | node.hash",
        "        return node.last_access << 128 | node.depth << 64 | node.hash",
    ),
    (
        "health bits ignored",
        "tpcache/core/round.py",
        '        if a.hi["health"] != 0 or not a.agreed("health"):',
        "        if False:",
    ),
    (
        "shared-memory all-reduce returns the rank's own vector",
        "tpcache/comm/shm.py",
        "        return elementwise_min([values, *peers.values()])",
        "        return values",
    ),
    (
        "a device page is not re-offered when a host-only page below it changes",
        "tpcache/core/treecore/candidates.py",
        "        if parent is not node.parent and parent.device_state == DeviceState.VALID:",
        "        if False:",
    ),
    (
        "a refused write-back alloc evicts clean pages first",
        "tpcache/core/treecore/eviction.py",
        "and (not self.write_back or self._clean_suffices(short))",
        "and True",
    ),
    # hybrid models: SWA pages and Mamba states
    (
        "a hit served without its SWA window valid",
        "tpcache/core/hitrule.py",
        "        if window and swa_ok is not None:",
        "        if False:",
    ),
    (
        "a Mamba state (or SWA page) read while it is still loading",
        "tpcache/core/treecore/components.py",
        "    if rec[b + DEV] == _VALID:\n        return 1",
        "    if rec[b + DEV] != 0:\n        return 1",
    ),
    (
        "the component record left out of the state digest",
        "tpcache/core/treecore/accounting.py",
        '        packed += array("q", node.comp).tobytes()',
        "        pass",
    ),
    (
        "a lease released while a load still writes into its component slots",
        "tpcache/core/loads.py",
        "        if op is not None:\n            self.book.wait_for(lease, op.op_id)\n",
        "        if op is not None:\n            if plan is None:\n"
        "                self.book.wait_for(lease, op.op_id)\n",
    ),
    (
        "a component copy that failed on some rank becomes valid",
        "tpcache/core/completions.py",
        "                    core.update(node_id, part=c, host_pins=-1)\n                    if i < ok:",
        "                    core.update(node_id, part=c, host_pins=-1)\n                    if True:",
    ),
    (
        "out-of-window release frees SWA inside the protected prefix",
        "tpcache/core/hybrid.py",
        "        behind = set(path[lease.hit_pages : max(lease.hit_pages, end)])",
        "        behind = set(path[: max(0, end)])",
    ),
    (
        "out-of-window release leaves a leaf without SWA",
        "tpcache/core/hybrid.py",
        "        end = self._last_state(path) - self.window\n",
        "        end = self._last_state(path) - self.window + 1\n",
    ),
    (
        "out-of-window release frees the window before the path's last state",
        "tpcache/core/hybrid.py",
        "            if self._comp(path[q - 1])[dev]:\n                return q\n",
        "            if self._comp(path[q - 1])[dev]:\n                return len(path)\n",
    ),
    (
        "a pinned component copy counts as evictable",
        "tpcache/core/treecore/components.py",
        "    return rec[b + DEV] == _VALID and rec[b + DPINS] == 0\n",
        "    return rec[b + DEV] == _VALID\n",
    ),
    (
        "the round's layout field ignores the components' KV layouts",
        "tpcache/core/round.py",
        "+ ([kv_layout] if kv_layout else [])",
        "",
    ),
    (
        "a hit pins and stamps SWA data along its whole path, not only its window",
        "tpcache/core/hybrid.py",
        "            out += [(self.window_part, nodes[i]) for i in window_range(p, self.window)]",
        "            out += [(self.window_part, nodes[i]) for i in range(p)]",
    ),
    # state that decides what happens next, which the round's state digest must cover
    (
        "the retention cap left out of the state digest",
        "tpcache/core/cache.py",
        "            backlog,\n            self.evictor.retention_cap_tokens,\n",
        "            backlog,\n",
    ),
    (
        "a lease's pages left out of its record",
        "tpcache/core/treecore/accounting.py",
        "        lease.pages.total,\n",
        "0,\n",
    ),
    (
        "a lease's prefetch and admission state left out of its record",
        "tpcache/core/treecore/accounting.py",
        "        mix_ids(prefetch_fields) if prefetch_fields else NO_IDS,\n",
        "        NO_IDS,\n",
    ),
    (
        "the backup backlog left out of the state digest",
        "tpcache/core/cache.py",
        "backlog = mix_ids(list(led.backup_backlog)) if led.backup_backlog else _NO_BACKLOG",
        "backlog = _NO_BACKLOG",
    ),
    (
        "a flush goes ahead while the ranks hold different leases",
        "tpcache/core/round.py",
        '            if agreement.agreed("leases"):',
        "            if True:",
    ),
    (
        "health bits ignored when every rank reports the same ones",
        "tpcache/core/round.py",
        '        if a.hi["health"] != 0 or not a.agreed("health"):',
        '        if not a.agreed("health"):',
    ),
    (
        "a unanimous round is clear whatever its health bits",
        "tpcache/core/round.py",
        "            clear = values[self._at_health] == 0\n",
        "            clear = True\n",
    ),
    # the native core's own copy of a promise
    (
        "a lease's pages left out of its record, in the native core (a holding's entry left out of its term)",
        "tpcache/core/treecore/_account.c",
        "    write64(buf + 16, (uint64_t)key);\n",
        "    write64(buf + 16, 0);\n",
    ),
]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files += [str(p.relative_to(ROOT)) for p in ROOT.glob("**/*.so") if ".venv" not in p.parts]
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def tree_core_for(path: str, choice: str) -> str:
    """The tree core the rings run on for a mutant of ``path``: ``auto`` is the reference for a
    Python file (the mutated code then runs), native for anything else."""
    if choice != "auto":
        return choice
    return "reference" if path.endswith(".py") else "native"


def rebuild(dest: Path, path: str) -> bool:
    """Build the extensions of the copy again after a mutant of the native source ``path``. Its
    folder's built extensions are removed first: an optional extension that fails to build must
    not leave the unmutated one in place. Returns whether they were all built again."""
    built = list((dest / path).parent.glob("*.so"))
    for so in built:
        so.unlink()
    cmd = [sys.executable, "-c", "from setuptools import setup; setup()", "build_ext", "--inplace", "-q"]
    subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    return all(so.exists() for so in built)


def run_rings(dest: Path, core: str, workers: int, rings: list[str]) -> tuple[list[str], int, float]:
    """Run the rings in ``dest`` on the tree core ``core``: (FAILED lines, exit status, seconds)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", str(workers)]
    cmd += ["--ignore", SELF_CHECK]  # it fails on any mutated copy: a kill by it would prove nothing
    env = {**os.environ, "TPCACHE_TREE_CORE": core}
    proc = subprocess.run([*cmd, *rings], cwd=dest, capture_output=True, text=True, env=env)
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    return failed, proc.returncode, round(time.perf_counter() - start, 1)


def baseline(cores: set[str], workers: int, rings: list[str]) -> list[str]:
    """The rings on the unmutated tree, on each tree core the mutants run on: what fails there
    (a mutant "killed" by a test that fails anyway proves nothing)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="tpcache-baseline-") as tmp:
        copy_tree(Path(tmp))
        for core in sorted(cores):
            failed, returncode, _ = run_rings(Path(tmp), core, workers, rings)
            if returncode != 0:
                problems.append(f"unmutated, on the {core} tree core: {' '.join(failed[:1]) or f'exit {returncode}'}")
    return problems


def run_mutant(index: int, workers: int, rings: list[str], tree_core: str = "auto") -> dict[str, object]:
    what, path, old, new = MUTANTS[index]
    core = tree_core_for(path, tree_core)
    with tempfile.TemporaryDirectory(prefix="tpcache-mutant-") as tmp:
        dest = Path(tmp)
        copy_tree(dest)
        source = (dest / path).read_text()
        if source.count(old) != 1:
            return {"mutant": index, "what": what, "result": "not applicable (text not found once)"}
        (dest / path).write_text(source.replace(old, new))
        if not path.endswith(".py") and not rebuild(dest, path):
            return {"mutant": index, "what": what, "result": "error (the mutated extension did not build)"}
        failed, returncode, seconds = run_rings(dest, core, workers, rings)
        result = "killed" if failed else "SURVIVED" if returncode == 0 else "error"
        return {
            "mutant": index,
            "what": what,
            "tree_core": core,
            "result": result,
            "by": failed[:1],
            "seconds": seconds,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, action="append", help="run only these mutant numbers")
    ap.add_argument("--workers", type=int, default=2)
    rings = ["tests/treecore", "tests/unit", "tests/sim"]
    ap.add_argument("--rings", nargs="+", default=rings, help="test paths to run")
    ap.add_argument(
        "--tree-core",
        choices=("auto", "reference", "native"),
        default="auto",
        help="the tree core the rings run on (auto: reference for a mutant of a Python file)",
    )
    ap.add_argument("--baseline", action="store_true", help="first check the rings pass on the unmutated tree")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    chosen = args.only or range(len(MUTANTS))
    if args.baseline:
        problems = baseline({tree_core_for(MUTANTS[i][1], args.tree_core) for i in chosen}, args.workers, args.rings)
        for line in problems:
            print(f"the rings fail without a mutant: {line}")
        if problems:
            return 2
    rows = [run_mutant(i, args.workers, args.rings, args.tree_core) for i in chosen]
    if args.json:
        print(json.dumps({"mutants": rows, "survived": sum(r["result"] != "killed" for r in rows)}))
    else:
        for r in rows:
            core = r.get("tree_core", "")
            print(f"{r['mutant']:2} {r['result']:9} {core:9} {r['what']}  {' '.join(r.get('by', []))}")
    return 0 if all(r["result"] == "killed" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
