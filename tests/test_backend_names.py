"""No module decides anything by an index backend's name outside the backends themselves
(``index/*backend*.py``, the registry ``index/backends.py`` included): what differs between backends is an
``index.protocol.Capabilities`` fact, checked where it matters (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from foundation.families import Backend

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("foundation", "index", "engine", "app", "cli", "training", "bench")
NAMES = {backend.value for backend in Backend}
MEMBERS = {backend.name for backend in Backend}


def _names_a_backend(node: ast.expr) -> bool:
    """``"faiss"`` (in any case) or ``Backend.FAISS``, or a tuple, list or set holding one."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(map(_names_a_backend, node.elts))
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in NAMES
    return (
        isinstance(node, ast.Attribute)
        and node.attr in MEMBERS
        and isinstance(node.value, ast.Name)
        and node.value.id == Backend.__name__
    )


def name_comparisons(source: str) -> list[int]:
    """The lines where ``source`` compares something with a backend's name (``==``, ``is``, ``in``...)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare) and any(map(_names_a_backend, [node.left, *node.comparators]))
    ]


def test_no_module_outside_the_backends_compares_a_backend_name() -> None:
    modules = [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]
    outside = [path for path in modules if not (path.parent.name == "index" and "backend" in path.stem)]
    assert len(modules) - len(outside) == 3  # faiss_backend, milvus_backend, backends
    found = [
        f"{path.relative_to(REPO)}:{line}" for path in outside for line in name_comparisons(path.read_text())
    ]
    assert found == [], "check a Capabilities fact (index.backends.capabilities_of) instead of the name"


def test_each_way_of_comparing_a_name_is_seen() -> None:
    source = """
if manifest.backend == "faiss": pass
if backend is Backend.MILVUS: pass
ok = "Milvus" != kind
ok = backend in ("faiss", "other")
ok = backend == other_backend
ok = capabilities.lives_in_folder
"""
    assert name_comparisons(source) == [2, 3, 4, 5]
