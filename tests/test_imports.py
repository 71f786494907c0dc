"""The import graph points down: every module imports only from its own layer or those below
(the layers are the table in docs/architecture.md), no module imports, however lazily, one that
imports it back, the subpackages form no cycle among themselves, and the contract imports
nothing of infinikv's but its error type. Read from the source with ``ast`` (every import, inside functions too; those
under ``if TYPE_CHECKING:`` serve annotations only and do not count)."""

import ast
import re
from pathlib import Path

import infinikv

ROOT = Path(infinikv.__file__).parent
ARCHITECTURE = Path(__file__).parent.parent / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("infinikv", *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The infinikv modules ``name`` imports (a ``from PACKAGE import NAME`` of a submodule counts as it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def top(name: str) -> str:
    """The subpackage (or top-level module) a module belongs to: ``infinikv.cache.layer`` -> ``infinikv.cache``."""
    return ".".join(name.split(".")[:2])


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(graph()) == []


def test_subpackages_form_no_cycle():
    edges = graph()
    tops = {top(m) for m in edges if m != "infinikv"}
    packages = {t: set() for t in tops}
    for name, targets in edges.items():
        if name != "infinikv":
            packages[top(name)].update(top(t) for t in targets if t != "infinikv" and top(t) != top(name))
    assert cycles(packages) == []
    assert "infinikv.bench" not in packages["infinikv.eval"] and "infinikv.eval" not in packages["infinikv.bench"]


def test_the_contract_and_storage_know_no_policy():
    edges = graph()
    assert edges["infinikv.contract"] <= {"infinikv.errors"}
    for name, targets in edges.items():
        if name.startswith(("infinikv.kv", "infinikv.cache")):
            assert not any(t.startswith("infinikv.policies") for t in targets), name


def layers() -> dict[str, int]:
    """Each subpackage or top-level module's layer, from the table in docs/architecture.md: 0 = top."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("<!-- layers") : text.index("<!-- /layers -->")]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "`" in line]
    return {f"infinikv.{name}": depth for depth, row in enumerate(rows) for name in re.findall(r"`(\w+)`", row)}


def upward(edges: dict[str, set[str]], depth: dict[str, int]) -> list[str]:
    """The imports that go from a layer to one above it."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        if name != "infinikv"
        for target in targets
        if target != "infinikv" and depth[top(target)] < depth[top(name)]
    )


def test_every_import_points_down_the_layers():
    depth = layers()
    edges = graph()
    missing = sorted({top(m) for m in edges if m != "infinikv"} - set(depth))
    assert not missing, f"not in the layers table of docs/architecture.md: {missing}"
    assert upward(edges, depth) == []


def test_an_upward_import_is_found():
    depth = layers()
    assert depth["infinikv.cli"] < depth["infinikv.core"] < depth["infinikv.policies"] < depth["infinikv.kv"]
    assert upward({"infinikv.kv.slots": {"infinikv.core"}}, depth) == ["infinikv.kv.slots -> infinikv.core"]
