"""docs/ARCHITECTURE.md is the map of the code: every module of the three packages is on it, every
folder keeps to about a dozen modules and states its role, and nothing on the map is gone."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("whalelike", "planner", "runtime")
MAP = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
MOST_MODULES_PER_FOLDER = 12


def _modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _folders() -> list[Path]:
    return sorted({m.parent for m in _modules()})


@pytest.mark.parametrize("module", [str(m) for m in _modules()])
def test_every_module_is_on_the_map(module):
    assert re.search(rf"(?<![\w/]){re.escape(module)}\b", MAP), (
        f"{module} is not named in docs/ARCHITECTURE.md; add its line to the table of its folder")


def test_nothing_on_the_map_is_gone():
    named = set(re.findall(r"(?<![\w/])((?:whalelike|planner|runtime)/[\w/]+\.py)", MAP))
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"


@pytest.mark.parametrize("folder", [str(f) for f in _folders()])
def test_each_folder_is_one_role_of_at_most_a_dozen_modules(folder):
    modules = [p for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MOST_MODULES_PER_FOLDER, (
        f"{folder} holds {len(modules)} modules; split it by role (at most {MOST_MODULES_PER_FOLDER})")
    doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
    assert doc and "Invariant" in doc, (
        f"{folder}/__init__.py must state the folder's role and its invariant in its docstring")
