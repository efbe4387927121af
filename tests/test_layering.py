"""accord's modules import each other in one direction: no import circles, and no module
imports a layer above its own. Imports inside functions count too (they run, only later);
those under `if TYPE_CHECKING:` do not."""

import ast
from pathlib import Path

import accord

SRC = Path(accord.__file__).parent

# Low to high; a module may import its own layer and those below. A new top-level package or
# module needs its place here.
LAYERS = [
    {"errors", "stopping", "faults", "registry", "atomic", "compat"},
    {"recipe"},
    {"distributed"},
    {"observe"},
    {"models"},
    {"data"},
    {"tasks"},
    {"engine"},
    {"checkpoint", "output"},
    {"run"},
    {"planner"},
    {"launch"},
    {"interop"},
    {"cli", "api", "__main__", ""},  # "": the package itself (accord/__init__.py)
]


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)"""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ["accord", *path.relative_to(SRC).with_suffix("").parts]
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


MODULES = _modules()


def _known(name: str) -> str:
    """The accord module an import of `name` runs (a name inside a module: that module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name) for a in node.names if a.name.split(".")[0] == "accord"]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    if base.split(".")[0] != "accord":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _known(base) for a in node.names]


def _type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _imports() -> dict[tuple[str, str], int]:
    """(importer, imported) -> line of the first such import, over every accord module."""
    edges: dict[tuple[str, str], int] = {}
    for module, (path, package) in MODULES.items():
        for node in _run_imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(module, package, node):
                # Every accord module runs the package itself first: an import of it
                # (accord.__version__) adds no order, and its lazy `accord.train` would
                # otherwise put everything in one circle with api.
                if target not in (module, "accord"):
                    edges.setdefault((module, target), node.lineno)
    return edges


def _run_imports(node: ast.AST):
    """The import statements under `node` that run, at import time or in a function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            yield from _run_imports(ast.Module(body=child.orelse, type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _run_imports(child)


EDGES = _imports()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in MODULES if "." in m and not any(m.split(".")[1] in s for s in LAYERS)})
    assert not unplaced, f"give these a place in LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} (line {line}) imports {b}" for (a, b), line in sorted(EDGES.items()) if _layer(a) < _layer(b)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b in EDGES:
        graph[a].add(b)
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    lines = []
    for circle in circles:
        members = set(circle)
        lines.append(" <-> ".join(circle))
        lines += [f"    {a} (line {line}) imports {b}" for (a, b), line in sorted(EDGES.items()) if {a, b} <= members]
    assert not circles, "import circles:\n" + "\n".join(lines)


def test_the_checker_sees_function_body_relative_and_package_imports():
    """What the checks above rely on: an import inside a function, a relative one, and a
    `from package import module` all name the module they run."""
    assert EDGES.get(("accord.output.folder", "accord.output.safetensors_writer"))  # inside a function
    assert _targets("accord.data.chunks", False, ast.parse("from .rows import IGNORE").body[0]) == ["accord.data.rows"]
    assert _targets("accord.engine", True, ast.parse("from . import base").body[0]) == ["accord.engine.base"]
    assert _targets("accord.x", False, ast.parse("from accord.checkpoint import node_folders").body[0]) == [
        "accord.checkpoint.node_folders"
    ]
    assert _layer("accord.data.rows") < _layer("accord.tasks.base") < _layer("accord.checkpoint.store")


# A module holds one job; past this many lines it holds several and is split along a seam.
MAX_MODULE_LINES = 500


def test_every_module_of_accord_its_benchmarks_and_scripts_is_at_most_500_lines():
    root = SRC.parent.parent
    files = [*SRC.rglob("*.py"), *(root / "benchmarks").glob("*.py"), *(root / "scripts").glob("*.py")]
    assert len(files) > 100  # the tree was found
    long = {
        str(path.relative_to(root)): n
        for path in files
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each along a seam, one job a module): {long}"
