"""The layering the design promises, checked from the source: no import cycles, a core with no
threads, clocks, sockets or torch.distributed, core modules small enough to read, and native sources
(C files and headers) small, in extensions of a bounded size, with no include cycle."""

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("tpcache", "protocol", "launcher")
CORE_FORBIDDEN = ("threading", "time", "socket", "random", "torch", "zmq", "asyncio", "datetime")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at run time or for type checking alone."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_has_no_threads_clocks_sockets_or_torch():
    for path in (REPO / "tpcache" / "core").glob("*.py"):
        roots = {name.split(".")[0] for name in _imports(path)}
        assert not roots & set(CORE_FORBIDDEN), f"{path.name} imports {sorted(roots & set(CORE_FORBIDDEN))}"


def test_core_modules_stay_small():
    for path in (REPO / "tpcache" / "core").glob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 430, f"{path.name} has {lines} lines: split it by concept"  # "about 400"


# ----------------------------------------------------------------------------- native sources

NATIVE_ROOTS = ("tpcache", "protocol")
# The most bytes each built extension may take (it is built with -O2 and the interpreter's -g):
# past it, a kernel grew into something to split or to look at.
EXTENSION_BYTES = {
    "tpcache.core._node": 800 << 10,
    "tpcache.io._rowcopy": 160 << 10,
    "tpcache.io._record": 200 << 10,
    "protocol._speedups": 200 << 10,
}


def _native_sources() -> list[Path]:
    return sorted(p for root in NATIVE_ROOTS for ext in ("*.c", "*.h") for p in (REPO / root).rglob(ext))


def test_native_sources_stay_small():
    sources = _native_sources()
    assert len(sources) >= 10
    for path in sources:
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{path.relative_to(REPO)} has {lines} lines: split it by concern"


def test_every_built_extension_stays_under_its_size_cap():
    import tomllib

    declared = {
        m["name"] for m in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    }
    assert declared == set(EXTENSION_BYTES), "a new extension needs its size cap here"
    for name, cap in EXTENSION_BYTES.items():
        package, _, module = name.rpartition(".")
        for built in (REPO / package.replace(".", "/")).glob(f"{module}.*.so"):
            size = built.stat().st_size
            assert size <= cap, f"{built.relative_to(REPO)} is {size:,} bytes, its cap {cap:,}"


def _includes(path: Path) -> set[str]:
    """The project headers ``path`` includes (``#include "..."``), by name."""
    out = set()
    for line in path.read_text().splitlines():
        words = line.replace("#", "# ", 1).split()
        if len(words) >= 3 and words[:2] == ["#", "include"] and words[2].startswith('"'):
            out.add(words[2].strip('"'))
    return out


def test_native_headers_include_no_cycle():
    headers = {p.name: p for p in _native_sources() if p.suffix == ".h"}
    graph = {name: _includes(path) & set(headers) for name, path in headers.items()}
    for source in _native_sources():
        missing = _includes(source) - set(headers)
        assert not missing, f"{source.relative_to(REPO)} includes {sorted(missing)}, not a project header"
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        assert name not in stack, "native headers include each other: " + " -> ".join([*stack, name])
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
