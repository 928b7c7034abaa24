"""The layering the design promises, checked from the source: no import cycles, a core with no
threads, clocks, sockets or torch.distributed, core modules small enough to read, and native sources
(C files and headers) small, in extensions of a bounded size, with no include cycle; and code outside
the core reading its state only through its named queries."""

import ast
import re
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
    for path in (REPO / "tpcache" / "core").rglob("*.py"):
        roots = {name.split(".")[0] for name in _imports(path)}
        assert not roots & set(CORE_FORBIDDEN), f"{path.name} imports {sorted(roots & set(CORE_FORBIDDEN))}"


def test_core_modules_stay_small():
    for path in (REPO / "tpcache" / "core").rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 430, f"{path.name} has {lines} lines: split it by concept"  # "about 400"


# ----------------------------------------------------------------------------- native sources

NATIVE_ROOTS = ("tpcache", "protocol")
# The most bytes each built extension may take (it is built with -O2 and the interpreter's -g):
# past it, a kernel grew into something to split or to look at.
EXTENSION_BYTES = {
    "tpcache.core.treecore._node": 800 << 10,
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


# The native tree core calls no Python code and reads no Python attribute by name: what it needs is
# handed to it (arguments, a ``Heaps`` object, the values ``bind`` takes once). The row copy and the
# shard records (tpcache/io) are held to the same. An allowance (file: count) may only fall.
PYTHON_FROM_NATIVE_ROOTS = ("tpcache/core/treecore", "tpcache/io")
PYTHON_FROM_NATIVE_ALLOWED: dict[str, int] = {}
PYTHON_FROM_NATIVE = re.compile(
    r"\b(?:_?PyObject_(?:Call|Vectorcall|GetAttr|SetAttr|DelAttr)\w*|PyImport_\w+|PyEval_\w+|PyRun_\w+)\s*\("
)


def _python_from_native(text: str) -> list[str]:
    """The calls of Python code and attribute lookups by name in C source ``text``, comments left out."""
    code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))
    return [m.group(0).rstrip("( ") for m in PYTHON_FROM_NATIVE.finditer(code)]


def test_the_native_core_calls_no_python():
    sources = [p for root in PYTHON_FROM_NATIVE_ROOTS for ext in ("*.c", "*.h") for p in (REPO / root).glob(ext)]
    assert len(sources) >= 12
    found = {p.name: len(_python_from_native(p.read_text())) for p in sources}
    for name, count in sorted(found.items()):
        allowed = PYTHON_FROM_NATIVE_ALLOWED.get(name, 0)
        assert count <= allowed, f"{name} calls Python or reads attributes by name {count} times (allowed {allowed})"
        assert count == allowed, f"{name}: {count} calls of Python left, {allowed} allowed: lower its allowance"
    assert set(PYTHON_FROM_NATIVE_ALLOWED) <= set(found), "an allowance for a file that is gone"


def test_the_check_of_python_from_native_finds_them():
    sample = """
    /* PyObject_GetAttr(o, name) in a comment is not a call */
    PyObject *v = PyObject_GetAttrString(o, "x"), *r = PyObject_CallOneArg(fn, v);
    int rc = PyObject_SetAttr(o, name, v);  // PyImport_ImportModule("x") here neither
    PyObject *m = PyImport_ImportModule("array"), *s = PyObject_CallMethod(m, "f", NULL);
    r = PyObject_Vectorcall(fn, args, 2, NULL); r = _PyObject_CallNoArgs(fn);
    PyObject_RichCompareBool(a, b, Py_LT); PyList_Append(l, v); PyObject_GetBuffer(o, &view, 0);
    """
    found = _python_from_native(sample)
    assert found == [
        "PyObject_GetAttrString",
        "PyObject_CallOneArg",
        "PyObject_SetAttr",
        "PyImport_ImportModule",
        "PyObject_CallMethod",
        "PyObject_Vectorcall",
        "_PyObject_CallNoArgs",
    ]


# ----------------------------------------------------------------------------- the core's state, from outside

# Code that drives a bare core in place of the driver and checks its internals: the simulator's and
# the tests' harness, and the trace replay (a benchmark of the core alone).
CORE_HARNESS = ("tpcache/core/", "tpcache/testing/", "tpcache/replay.py")
# What the core keeps to itself: its tree, its queues of ops in flight, its ledger and outbox, and
# (on the core) its lease table and lease records. Outside code asks ``queries.Queries`` instead.
CORE_INTERNALS = ("tree", "treecore", "inflight", "ledger", "outbox")
# Checked on ``core`` and ``<x>.core`` only (a service has a lease book too): its lease records and the
# layers it is composed of.
CORE_RECORDS = ("leases", "lease", "book", "backup", "staging", "admitter", "evictor", "part_evictor", "hybrid")
CORE_RECORDS += ("prefetcher", "loader", "inserter", "completions", "engine_pages", "candidates", "device", "host")
# A node's field names that nothing else uses (a request's ``tokens`` or a digest's ``record`` are
# other objects' fields as well, so those common names are left out; so are a tensor's ``device``
# and the ``node_id`` of SGLang's lock receipts).
NODE_COMMON_NAMES = {"parent", "children", "tokens", "hash", "depth", "hits", "record", "run", "device", "node_id"}


def _node_fields() -> set[str]:
    from tpcache.core.treecore.tree import PyNode

    properties = {name for name, value in vars(PyNode).items() if isinstance(value, property)}
    return (set(PyNode.__slots__) | properties) - NODE_COMMON_NAMES


def _on_core(value: ast.expr) -> bool:
    name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
    return name == "core"


def _core_state_reads(source: str, name: str, node_fields: set[str]) -> list[str]:
    """``name:line .attr`` of every read of the core's own state in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Attribute):
            continue
        internal = node.attr in CORE_INTERNALS or node.attr in node_fields
        if internal or node.attr in CORE_RECORDS and _on_core(node.value):
            found.append(f"{name}:{node.lineno} .{node.attr}")
    return found


def test_code_outside_the_core_reads_its_state_only_through_queries():
    """The service, the engine, the integrations and the event stream never read the core's tree,
    a node's fields, its queues of ops in flight or its lease records: only the core's named
    queries, which return plain values (``tpcache.core.queries``)."""
    node_fields = _node_fields()
    assert {"device_state", "device_page", "host_state", "device_valid"} <= node_fields
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    checked = [p for p in files if not str(p.relative_to(REPO)).startswith(CORE_HARNESS)]
    assert any("service" in p.parts for p in checked) and any("integrations" in p.parts for p in checked)
    found = [hit for p in checked for hit in _core_state_reads(p.read_text(), str(p.relative_to(REPO)), node_fields)]
    assert not found, "reads of the core's own state outside it (add a query to tpcache/core/queries.py): " + (
        "; ".join(found)
    )


def test_the_check_of_core_state_reads_finds_them():
    """The check above catches each kind of read it promises to (the service's old forms among them)."""
    sample = (
        "nodes = tp.core.tree.walk(tokens).nodes\n"
        "busy = any(self.cache.core.inflight.values())\n"
        "ops = self.tp.core.lease(lease).ops\n"
        "alive = lease in core.leases\n"
        "valid = nodes[0].device_valid and nodes[0].device_page\n"
        "fine = h.book.drop(lease), body.tokens, item.record, tp.device, self.tp.host_pool\n"
        "down = core.backup.storage_down\n"
    )
    found = sorted(hit.partition(":")[2] for hit in _core_state_reads(sample, "sample.py", _node_fields()))
    expected = ["1 .tree", "2 .inflight", "3 .lease", "4 .leases", "5 .device_page", "5 .device_valid", "7 .backup"]
    assert found == expected, found


# ----------------------------------------------------------------------------- the tree core's seam

# A lease's and a prefetch's ``tokens`` and a lease's ``record`` share names with a node's fields.
SEAM_COMMON_NAMES = {"tokens", "record"}


def _node_field_reads(source: str, name: str, fields: set[str]) -> list[str]:
    """``name:line .attr`` of every read of a node field on anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        on_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Attribute) and node.attr in fields and not on_self:
            found.append(f"{name}:{node.lineno} .{node.attr}")
    return found


def _seam_fields() -> set[str]:
    from tpcache.core.treecore.tree import PyNode

    members = {name for name, value in vars(PyNode).items() if not name.startswith("_")}
    return (set(PyNode.__slots__) | members) - SEAM_COMMON_NAMES


def test_only_the_tree_core_reads_a_nodes_fields():
    """Orchestration talks to the tree core by node id: outside ``tpcache/core/treecore`` no module of
    the core reads a node's fields."""
    fields = _seam_fields()
    assert {"device_state", "host_slot", "comp", "parent", "children", "node_id", "path"} <= fields
    paths = sorted((REPO / "tpcache" / "core").glob("*.py"))
    assert {"backup.py", "inserts.py", "hybrid.py"} <= {p.name for p in paths}
    found = [hit for path in paths for hit in _node_field_reads(path.read_text(), path.name, fields)]
    assert not found, "node fields read outside the tree core (ask TreeCore by id): " + "; ".join(found)


def test_no_module_outside_the_tree_core_holds_a_node_handle():
    """Orchestration keeps and passes node ids only: no module of the core outside ``treecore`` names
    the node type or reads a walk's nodes (a walk is read by its ``ids``), and the tree core offers
    no conversion to handles."""
    paths = sorted((REPO / "tpcache" / "core").glob("*.py"))
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "tpcache.core.treecore.tree":
                found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name == "Node"]
            elif isinstance(node, ast.Attribute) and node.attr in ("ids_of", "handles", "id_of"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Attribute) and node.attr == "nodes" and "walk" in ast.unparse(node.value):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, "node handles outside the tree core (keep node ids): " + "; ".join(found)
    from tpcache.core.treecore import TreeCore

    assert not {"ids_of", "handles", "id_of"} & set(dir(TreeCore))


def test_the_check_of_node_field_reads_finds_them():
    sample = (
        "state = node.device_state\n"
        "up = nodes[0].parent.host_slot\n"
        "mine = self.device_state, lease.tokens, lease.record\n"
        "ids = [n.node_id for n in op.nodes]\n"
        "ok = core.treecore.device(node_id)\n"
    )
    found = sorted(hit.partition(":")[2] for hit in _node_field_reads(sample, "sample.py", _seam_fields()))
    assert found == ["1 .device_state", "2 .host_slot", "2 .parent", "4 .node_id"], found
