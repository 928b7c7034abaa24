"""Every command and code block in README.md and docs/ works as written, or says why it is not run here.

See tests/docs/blocks.py for the markers. A block is run from the repository root in a fresh
temporary directory as TMPDIR (a path under /tmp/ in a block becomes a path under it: the storage
directories the docs name), with the venv's bin directory on PATH and the repository on PYTHONPATH.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import BIGGER, REPO, Block, all_blocks, blocks_of, doc_pages, rendered

README_LIMIT = 12 * 1024
CELL_LIMIT = 300
RUN_TIMEOUT_S = 240
# Words about the project's own history, which a reader cannot use.
HISTORY = re.compile(
    r"seed 00\d|issue \d+|issue's items|this stop|last stop|before this (change|stop)|stop's|not settled",
    re.I,
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")

BLOCKS = [b for b in all_blocks() if b.kind != "text"]


def block_params() -> list:
    params = []
    for block in BLOCKS:
        marks = []
        if block.kind == "run":  # started processes; one worker runs them all, one at a time
            marks = [pytest.mark.multiprocess, pytest.mark.xdist_group("doc_blocks")]
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


def block_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPCACHE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["TMPDIR"] = str(tmp)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_block(block: Block, tmp: Path) -> subprocess.CompletedProcess[str]:
    """Runs the block as written, in its own session; whatever it leaves running is stopped after."""
    if block.lang == "shell":
        script = tmp / "block.sh"
        script.write_text(block.script().replace("/tmp/", f"{tmp}/"))
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
    else:
        script = tmp / "block.py"
        script.write_text(block.script())
        argv = [sys.executable, str(script)]
    proc = subprocess.Popen(
        argv, cwd=REPO, env=block_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{block.id}: did not finish in {RUN_TIMEOUT_S} s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # a service the block started and left running
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def check_syntax(block: Block, tmp: Path) -> None:
    if block.lang == "shell":
        script = tmp / "block.sh"
        script.write_text(block.script())
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{block.id}: {check.stderr}"
    else:
        compile(block.text, block.id, "exec")


def target_source(target: str) -> str:
    """The text a tested-by target names: a file, or one test function's source in it."""
    path, _, name = target.partition("::")
    file = REPO / path
    assert file.is_file(), f"tested-by names {path}, which does not exist"
    text = file.read_text()
    if not name:
        return text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"tested-by names {target}, but {path} has no function {name}")


def unindented(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


@pytest.mark.parametrize("block", block_params())
def test_block(block: Block, tmp_path: Path) -> None:
    kind = block.kind
    if block.lang == "untagged":
        pytest.fail(f"{block.id}: untagged block; tag it (bash, python, text, ...) so the doc test knows what it is")
    if block.lang.startswith("other:"):
        pytest.fail(f"{block.id}: block tagged {block.lang[6:]!r}, which the doc test cannot check; use bash, "
                    "python, toml, json, yaml or text")  # fmt: skip
    if kind == "bad":
        pytest.fail(f"{block.id}: unknown marker <!-- doc: {block.marker} --> (see tests/docs/blocks.py)")
    if kind == "data":
        import tomllib  # Python 3.11+; the launcher reads TOML with it too

        {"toml": tomllib.loads, "json": json.loads, "yaml": yaml.safe_load}[block.lang[5:]](block.text)
    elif kind == "bigger":
        check_syntax(block, tmp_path)
        before = "\n".join((REPO / block.page).read_text().splitlines()[max(0, block.line - 25) : block.line])
        assert BIGGER in re.sub(r"<!--.*?-->", "", before).lower(), (
            f"{block.id}: marked as an example for bigger machines, but the text before it does not say so"
        )
    elif kind == "tested-by":
        sources = [target_source(t) for t in block.targets]
        if block.lang == "python":  # the block as an excerpt: its lines in order, indentation aside
            units, sources = [unindented(block.text)], [unindented(src) for src in sources]
        else:
            units = block.commands()
        for unit in units:
            assert any(unit in src for src in sources), (
                f"{block.id}: {unit[:200]!r} is not in {', '.join(block.targets)}, which the marker says run it"
            )
    else:
        run = run_block(block, tmp_path)
        output = run.stdout + run.stderr
        assert run.returncode == 0, f"{block.id}: exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
        for text in block.expect:
            assert text in output, f"{block.id}: {text!r} not in its output\n{output[-4000:]}"


def test_the_blocks_are_found() -> None:
    """The parser sees the README's two commands and the examples' blocks (a broken parser tests nothing)."""
    readme = [b for b in BLOCKS if b.page == Path("README.md")]
    assert readme and readme[0].commands() == ["make demo", "make test"], readme[:1]
    kinds = {b.kind for b in BLOCKS}
    assert {"run", "tested-by", "bigger"} <= kinds, kinds


def test_the_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes; at most {README_LIMIT}"
    first = text.split("```")[1].splitlines()
    assert first[0] == "bash" and first[1].startswith("make demo ") and first[2].startswith("make test "), first


def test_no_page_speaks_of_the_projects_history() -> None:
    found = [
        f"{page}:{n}: {m.group(0)!r}"
        for page in doc_pages()
        for n, line in enumerate((REPO / page).read_text().splitlines(), 1)
        if (m := HISTORY.search(line))
    ]
    assert not found, "history words in the docs:\n" + "\n".join(found)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    out = set()
    for line in rendered(page).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in doc_pages():
        for target in LINK.findall(rendered(page)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (REPO / page).parent / path if path else REPO / page
            if not dest.exists():
                broken.append(f"{page}: {target} (no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.relative_to(REPO)):
                broken.append(f"{page}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_index() -> None:
    index = REPO / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in LINK.findall(index.read_text())}
    missing = [str(p) for p in doc_pages() if p.parts[0] == "docs" and p.name != "index.md" and REPO / p not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_table_cells_are_short() -> None:
    long = [
        f"{page}:{n}: a cell of {len(cell.strip())} characters"
        for page in doc_pages()
        for n, line in enumerate((REPO / page).read_text().splitlines(), 1)
        if line.startswith("|")
        for cell in re.split(r"(?<!\\)\|", line)
        if len(cell.strip()) > CELL_LIMIT
    ]
    assert not long, f"table cells over {CELL_LIMIT} characters:\n" + "\n".join(long)


def test_make_demo_runs_the_launcher_demo(tmp_path: Path) -> None:
    """`make demo` sets up the venv, then runs the demo (tests/mp/test_launcher.py runs a smaller one).
    A dry run: the setup it would do is printed, not done."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # not a sub-make
    env["MAKEFLAGS"] = "--dry-run"
    dry = subprocess.run("make demo", shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert ".venv/bin/python -m launcher demo" in dry.stdout.splitlines(), dry.stdout


SAMPLE = """# a page

```
tpcache: configuration error: something
```

```
.venv/bin/python -m launcher serve --help
```

<!-- doc: expect "a b" expect 'say "c"' -->
```console
$ echo 'a # b' \\
    c   # a comment
a # b c
```

<!-- doc: tested-by tests/x.py::test_y -->
```bash
make demo   # the demo
```
"""


def test_the_parser_reads_tags_markers_and_commands() -> None:
    output, command, console, tested = blocks_of(Path("page.md"), SAMPLE)
    assert (output.lang, command.lang) == ("untagged", "shell")  # output must be tagged; a command is shell
    assert command.kind == "run" and command.commands() == [".venv/bin/python -m launcher serve --help"]
    assert console.kind == "run" and console.expect == ["a b", 'say "c"']
    assert console.commands() == ["echo 'a # b' c"]  # no prompt, no output, continuation joined
    assert tested.kind == "tested-by" and tested.targets == ["tests/x.py::test_y"] and tested.line == 19
    assert tested.commands() == ["make demo"]


def test_a_failing_block_fails(tmp_path: Path) -> None:
    """A block runs under bash -e: a failure in its middle is its exit status."""
    block = Block(Path("page.md"), 1, "shell", "false\necho after\n")
    assert run_block(block, tmp_path).returncode != 0
    block = Block(Path("page.md"), 1, "python", "raise SystemExit(3)\n")
    assert run_block(block, tmp_path).returncode == 3
