"""The import rules of docs/architecture.md, read from the imports themselves (deferred ones inside functions
too): each package imports only the packages below it, each room of ``engine`` only the rooms below it (plus
the few arrows back that are named here, each with its reason), and no module imports itself round a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
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
# engine's rooms -> the rooms they may import (docs/architecture.md, "The rooms of engine"), lowest first.
ROOMS = {
    "model": set(),
    "decode": {"model"},
    "gallery": {"decode", "model"},
    "build": {"gallery", "decode", "model"},
    "serve": {"gallery", "decode", "model"},
    "duplicates": {"build", "serve", "gallery", "decode", "model"},
}
# The arrows back up the rooms, module to module: each is allowed alone, for its reason, and must be in use.
BACK_ARROWS = {
    ("engine.decode.model_input", "engine.duplicates.signature"): (
        "a decode computes the image's perceptual signature from the pixels it decoded for the model"
    ),
    ("engine.build.prefetch", "engine.duplicates.signature"): (
        "build-index's decode task, likewise: one decode gives the model input and the signature"
    ),
    ("engine.serve.search", "engine.duplicates.finder"): (
        "SearchService holds the duplicate finder among the jobs that share the served bundle's lock"
    ),
    ("engine.serve.item_writer", "engine.duplicates.review"): (
        "a delete sets the photo aside as the duplicate review does, so that no build indexes it again"
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in ALLOWED for path in (REPO / package).rglob("*.py")}


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module can run, at module level or inside functions; not those under TYPE_CHECKING."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            yield from (n for child in node.orelse for n in runtime_imports(ast.Module([child], [])))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from runtime_imports(node)


@cache
def imported_modules(module: str, *, typing_too: bool) -> frozenset[str]:
    """The project modules ``module`` imports (``from package import submodule`` names the submodule)."""
    tree = ast.parse(project_modules()[module].read_text())
    nodes = ast.walk(tree) if typing_too else runtime_imports(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    found = set()
    for name in names:
        while name and name not in project_modules():
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return frozenset(found)


def imported_packages(path: Path) -> set[str]:
    """The project packages a module imports, at any depth (deferred imports inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & ALLOWED.keys()


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


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


def test_no_import_cycle_between_project_modules() -> None:
    graph = {module: imported_modules(module, typing_too=False) for module in project_modules()}
    assert cycles(graph) == [], "import cycles, deferred imports counted"


def test_every_engine_module_lives_in_a_room() -> None:
    rooms = {path.parent.name for path in (REPO / "engine").glob("*/__init__.py")}
    assert rooms == ROOMS.keys()
    loose = [name for name in project_modules() if name.startswith("engine.") and room_of(name) not in ROOMS]
    assert loose == []


def test_the_rooms_of_engine_are_layered() -> None:
    assert cycles({room: frozenset(below) for room, below in ROOMS.items()}) == []
    offending = []
    used = set()
    for module in project_modules():
        room = room_of(module)
        if room is None:
            continue
        for target in imported_modules(module, typing_too=True):
            target_room = room_of(target)
            if target_room is None or target_room == room or target_room in ROOMS[room]:
                continue
            if (module, target) in BACK_ARROWS:
                used.add((module, target))
            else:
                offending.append(f"{module} -> {target}")
    assert sorted(offending) == [], f"engine rooms may import only the rooms below them: {ROOMS}"
    assert used == BACK_ARROWS.keys(), "an allowed arrow back is no longer used: remove it from BACK_ARROWS"


def test_the_cycle_finder_names_a_cycle() -> None:
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert cycles(graph) == [["a", "b", "c"]]
