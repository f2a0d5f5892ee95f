"""No import cycles in whalelike/, planner/ and runtime/.

The graph: one node per module of the three packages, an edge ``a -> b`` when ``a`` imports ``b``
at module level (statements at the top of the module, including those inside a top-level ``if`` or
``try``, but not the body of ``if TYPE_CHECKING:``, which never runs). ``import x.y`` is an edge to
``x.y``; ``from x import y`` to ``x.y`` when that is a module, else to ``x`` (modules outside the
three packages are left out). Importing ``x.y`` also runs ``x/__init__.py``; that implicit edge is
left out, since every module of a package would otherwise sit on a cycle through the package's
``__init__``, which imports its public modules.

A cycle is a module that can only be imported while another is half-initialised: the order of
imports then decides whether a name exists yet. Definitions move to their owner to break one; a
function-local import that stands in for a module-level one would only hide it, so in planner/ and
whalelike/ no function-local import may close a cycle either.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("whalelike", "planner", "runtime")


def _module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(body: list[ast.stmt]):
    """Import statements that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level_imports(block)


def _known(name: str) -> str | None:
    """``name`` or its nearest enclosing module of the three packages (None: outside them)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.stmt) -> list[str]:
    """The modules of the three packages ``node`` (in ``module``) imports."""
    if isinstance(node, ast.Import):
        return [t for t in (_known(alias.name) for alias in node.names) if t]
    base = node.module or ""
    if node.level:   # relative: from the module's package, one level up per extra dot
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in MODULES else _known(base)
        if target:
            out.append(target)
    return out


def import_graph(function_local: bool = False) -> nx.DiGraph:
    """The module-level import graph; with ``function_local``, imports inside functions too."""
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = list(_top_level_imports(tree.body))
        if function_local:
            nodes += [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in nodes:
            graph.add_edges_from((module, target) for target in _targets(module, node) if target != module)
    return graph


def _cycles_through(graph: nx.DiGraph, package: str) -> list[str]:
    """Each cycle through a module of ``package``, as ``a -> b -> a``."""
    inside = lambda m: m == package or m.startswith(package + ".")  # noqa: E731
    return [" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(graph) if any(map(inside, cycle))]


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert len(MODULES) > 100 and set(PACKAGES) <= set(graph)
    assert graph.has_edge("planner.plan", "planner.plan_checks")           # from planner import plan_checks
    assert graph.has_edge("planner.api", "planner.decisions")              # from planner.decisions import ...
    assert graph.has_edge("planner", "planner.api")                        # the package's __init__
    assert not graph.has_edge("planner.plan_checks", "planner.plan")       # under TYPE_CHECKING only
    assert not graph.has_edge("whalelike.cli", "planner")                  # inside the commands
    assert graph.has_edge("runtime.engine", "planner.plan")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_level_import_cycle(package):
    cycles = _cycles_through(import_graph(), package)
    assert not cycles, f"import cycle(s) through {package}/: " + "; ".join(cycles)


@pytest.mark.parametrize("package", ["whalelike", "planner"])
def test_no_function_local_import_hides_a_cycle(package):
    cycles = _cycles_through(import_graph(function_local=True), package)
    assert not cycles, (f"a function-local import closes an import cycle through {package}/ (move the definition "
                        "to its owner instead): " + "; ".join(cycles))
