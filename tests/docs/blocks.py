"""The fenced blocks of README.md and docs/**/*.md, and the marker that says how each is checked.

A marker is one HTML comment on the line right before a block's fence (GitHub does not render it):

    <!-- doc: expect "TEXT" -->                 run it; TEXT must be in its output (several allowed;
                                                  'TEXT' in single quotes when it holds a double quote)
    <!-- doc: example for bigger machines -->   syntax check only; the page says so in words
    <!-- doc: tested-by TARGET [TARGET ...] -->  TARGET is a file (tests/x.py, .ci/run, examples/y.py)
                                                  or a test (tests/x.py::test_name) that runs the block
                                                  as written: each command of a shell block, or the
                                                  whole of a python block (indentation aside), must
                                                  appear in one of them

A block with no marker is run as written and must succeed. Blocks tagged ``text`` (output, file
trees), ``toml``, ``json`` or ``yaml`` (parsed) are not commands. An untagged block that looks like a
command is a shell block; any other untagged block is refused (tag it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
DATA = {"toml", "json", "yaml", "yml"}
TEXT = {"text", "txt"}

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!-- doc: (.*?) -->\s*$")
EXPECT = re.compile(r"""expect (?:"([^"]+)"|'([^']+)')""")
BIGGER = "example for bigger machines"
# First words of a line that makes an untagged block a command.
COMMAND_WORDS = re.compile(
    r"^(\$ |\.venv/|python3? |make |torchrun |pip |cd |export |curl |redis-server |unshare |sudo |apt-get |git )"
)


@dataclass
class Block:
    page: Path  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str  # "shell", "python", "data:<format>", "text"
    text: str
    marker: str = ""  # the marker's text, "" if none
    expect: list[str] = field(default_factory=list)
    console: bool = False  # a ``console`` block: the commands are the lines after "$ "

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """How the block is checked: run, bigger (syntax only), tested-by, data, text or bad (unknown marker)."""
        if self.lang == "text":
            return "text"
        if self.lang.startswith("data:"):
            return "data"
        if not self.marker or self.expect and EXPECT.sub("", self.marker).strip() == "":
            return "run"
        if self.marker == BIGGER:
            return "bigger"
        if self.marker.startswith("tested-by "):
            return "tested-by"
        return "bad"

    @property
    def targets(self) -> list[str]:
        return self.marker.split()[1:] if self.kind == "tested-by" else []

    def commands(self) -> list[str]:
        """The shell block's commands as a user types them: continuation lines joined, comment-only
        lines and trailing comments left out; in a ``console`` block only the lines after "$ "."""
        lines, pending = [], ""
        for raw in self.text.splitlines():
            if self.console and not pending:
                if not raw.startswith("$ "):
                    continue  # output
                raw = raw[2:]
            line = strip_comment(raw).strip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            if pending + line:
                lines.append(pending + line)
            pending = ""
        return lines

    def script(self) -> str:
        """What runs: a console block's commands, else the block as written."""
        return "\n".join(self.commands()) + "\n" if self.console else self.text


def strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a "#" after whitespace, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def doc_pages() -> list[Path]:
    """README.md and every page under docs/, relative to the repository root."""
    pages = [Path("README.md")] + sorted(p.relative_to(REPO) for p in (REPO / "docs").rglob("*.md"))
    return [p for p in pages if (REPO / p).exists()]


def classify(tag: str, body: str) -> str:
    tag = tag.lower()
    if tag in SHELL:
        return "shell"
    if tag in PYTHON:
        return "python"
    if tag in DATA:
        return "data:" + ("yaml" if tag == "yml" else tag)
    if tag in TEXT:
        return "text"
    if tag == "":
        first = next((line for line in body.splitlines() if line.strip() and not line.startswith("#")), "")
        return "shell" if COMMAND_WORDS.match(first) else "untagged"
    return "other:" + tag


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    """The page's fenced blocks (``text``: the page's content, read from the file if None)."""
    lines = ((REPO / page).read_text() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, tag, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = "\n".join(lines[start + 1 : j]) + "\n"
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        text = marker.group(1).strip() if marker else ""
        expect = [a or b for a, b in EXPECT.findall(text)]
        out.append(Block(page, start + 1, classify(tag, body), body, text, expect, tag == "console"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in doc_pages() for b in blocks_of(page)]


def rendered(page: Path) -> str:
    """The page's text as a reader sees it: HTML comments removed."""
    return re.sub(r"<!--.*?-->", "", (REPO / page).read_text(), flags=re.S)
