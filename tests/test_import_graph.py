"""No import cycle among the modules of whalelike/, planner/ and runtime/, and no private name
imported from one module into another.

The graph: one node per module of the three packages, an edge ``a -> b`` when ``a`` imports ``b``
anywhere: at module level, inside a function or a method, and under ``if TYPE_CHECKING:`` alike.
``import x.y`` is an edge to ``x.y``; ``from x import y`` to ``x.y`` when that is a module, else to
``x`` (modules outside the three packages are left out). Importing ``x.y`` also runs
``x/__init__.py``; that implicit edge is left out, since every module of a package would otherwise
sit on a cycle through the package's ``__init__``, which imports its public modules.

Why every import counts. A module-level cycle is a module that can only be imported while another is
half-initialised: the order of imports then decides whether a name exists yet. A function-local
import that stands in for a module-level one only hides that: the two modules still need each other,
and neither can be read, tested or moved alone. A type-only import is the same dependency in the
signatures. Definitions move to their owner to break one (a record below the modules that read it:
``planner/plan_record.py`` under the plan's checks and printout, ``planner/devices/stage_cost.py``
under the cost and memory models).

A private name (``_x``) is a module's own business; a module that needs another's names a public
interface (made public where it is one, or the code moved to its owner). :data:`PRIVATE_IMPORTS_ALLOWED`
lists the exceptions still needed, each with why; an entry no longer needed fails the test, so the
list only shrinks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("whalelike", "planner", "runtime")

# (importing module, owner module, name) -> why it is still imported
PRIVATE_IMPORTS_ALLOWED: dict = {}


def _module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _module_files()


class _Trees(dict):
    """Each module's syntax tree, parsed when first asked for (parsing all of them at import cost
    every pytest worker 2 s of collection, most of which never run these tests)."""

    def __missing__(self, module: str) -> ast.Module:
        tree = self[module] = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
        return tree


TREES = _Trees()


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


def _imports(module: str):
    """Every import statement of ``module``, wherever it stands."""
    return [n for n in ast.walk(TREES[module]) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph() -> nx.DiGraph:
    """The import graph of the three packages (module docstring: every import counts)."""
    graph = nx.DiGraph()
    for module in MODULES:
        graph.add_node(module)
        for node in _imports(module):
            graph.add_edges_from((module, target) for target in _targets(module, node) if target != module)
    return graph


def _cycles_through(graph: nx.DiGraph, package: str) -> list[str]:
    """Each cycle through a module of ``package``, as ``a -> b -> a``."""
    inside = lambda m: m == package or m.startswith(package + ".")  # noqa: E731
    return [" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(graph) if any(map(inside, cycle))]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports() -> dict[tuple[str, str, str], int]:
    """(importing module, owner module, private name) -> line, for each private name of one module of
    the three packages that another imports (``from owner import _x``) or reads off an imported module
    (``owner._x``, with ``owner`` bound by an import)."""
    found: dict[tuple[str, str, str], int] = {}
    for module in MODULES:
        bound: dict[str, str] = {}   # local name -> the module of the three packages it is bound to
        for node in _imports(module):
            for alias in node.names:
                if isinstance(node, ast.Import):
                    local = alias.asname or alias.name.partition(".")[0]
                    target = alias.name if alias.asname else alias.name.partition(".")[0]
                    if target in MODULES:
                        bound[local] = target
                    continue
                (target,) = _targets(module, ast.ImportFrom(module=node.module, names=[alias], level=node.level)) \
                    or (None,)
                if target is None:
                    continue
                if target.endswith("." + alias.name) and target in MODULES:   # a module, bound by name
                    bound[alias.asname or alias.name] = target
                elif _is_private(alias.name) and target != module:
                    found.setdefault((module, target, alias.name), node.lineno)
        for node in ast.walk(TREES[module]):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *reversed(chain)])
                if owner in MODULES and owner != module:
                    found.setdefault((module, owner, node.attr), node.lineno)
    return found


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert len(MODULES) > 100 and set(PACKAGES) <= set(graph)
    assert graph.has_edge("planner.plan", "planner.plan_checks")           # from planner import plan_checks
    assert graph.has_edge("planner.api", "planner.decisions")              # from planner.decisions import ...
    assert graph.has_edge("planner", "planner.api")                        # the package's __init__
    assert graph.has_edge("planner.plan_checks", "planner.plan_record")    # the record, below the checks
    assert not graph.has_edge("planner.plan_checks", "planner.plan")
    assert graph.has_edge("whalelike.cli", "planner")                      # inside the commands: counted
    assert graph.has_edge("runtime.balance.rebalance", "runtime.balance.straggler_monitor")   # TYPE_CHECKING
    assert graph.has_edge("runtime.engine", "planner.plan")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    cycles = _cycles_through(import_graph(), package)
    assert not cycles, (f"import cycle(s) through {package}/, counting imports inside functions and under "
                        "TYPE_CHECKING (move the definition to its owner, or a record below both): "
                        + "; ".join(cycles))


def test_the_private_name_check_sees_both_forms(tmp_path):
    """The check finds ``from owner import _x`` and ``owner._x`` (a seeded module, then removed)."""
    seeded = "planner._seeded_private_import"
    TREES[seeded] = ast.parse("from planner.groups import _KEYS\nimport planner.groups as g\ng._ORDERS\n")
    MODULES[seeded] = tmp_path / "_seeded_private_import.py"
    try:
        found = private_imports()
    finally:
        del TREES[seeded], MODULES[seeded]
    assert (seeded, "planner.groups", "_KEYS") in found and (seeded, "planner.groups", "_ORDERS") in found


def test_no_private_name_is_imported_across_modules():
    found = private_imports()
    bad = {key: line for key, line in found.items() if key not in PRIVATE_IMPORTS_ALLOWED}
    assert not bad, ("private names imported from another module (make the name public where it is an interface, "
                     "with a docstring, or move the code to its owner): "
                     + "; ".join(f"{m}:{line} uses {o}.{n}" for (m, o, n), line in sorted(bad.items())))
    stale = sorted(set(PRIVATE_IMPORTS_ALLOWED) - set(found))
    assert not stale, f"PRIVATE_IMPORTS_ALLOWED lists imports that are gone; remove them: {stale}"
