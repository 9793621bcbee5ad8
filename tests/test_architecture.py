"""The import rules of docs/architecture.md: each package imports only the packages below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package -> the project packages it may import (docs/architecture.md, "Packages and what each may import").
ALLOWED = {
    "foundation": set(),
    "index": {"foundation"},
    "engine": {"index", "foundation"},
    "training": {"engine", "index", "foundation"},
    "app": {"engine", "index", "foundation"},
    "cli": {"app", "engine", "index", "foundation", "training"},
}


def imported_packages(path: Path) -> set[str]:
    """The project packages a module imports, at any depth (deferred imports inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & ALLOWED.keys()


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_architecture_allows(package: str) -> None:
    modules = sorted((REPO / package).rglob("*.py"))
    assert modules
    offending = {
        str(path.relative_to(REPO)): sorted(imported - ALLOWED[package] - {package})
        for path in modules
        if (imported := imported_packages(path)) - ALLOWED[package] - {package}
    }
    assert offending == {}
