"""The product's modules import each other without a circle.

The graph is drawn from the source (the AST), with the code folders mapped onto their installed
names (scheduler/ -> orcaserve.scheduler, handler/ -> orcaserve.handler, kernels/ ->
orcaserve.kernels). Every import statement counts: at module level, inside functions (a deferred
import that closes a circle still ties the two modules' designs together) and under
`if TYPE_CHECKING:` (a type both sides need belongs in a module below both). An edge goes to the
module named, never to its parent packages: `import orcaserve.scheduler.core.request` does not
add an edge to `orcaserve.scheduler` (its `__init__` re-exports the public API and would join
every module into one circle). `from package import name` goes to `package.name` when that is a
module, else to `package`.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"scheduler": "orcaserve.scheduler", "handler": "orcaserve.handler", "kernels": "orcaserve.kernels"}

# Circles tolerated: none. A circle is tolerated while all its modules are in one entry.
EXPECTED_CYCLES: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if any(part.startswith(".") for part in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(name: str, source: str, is_package: bool, modules: Collection[str]) -> set[str]:
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    return {target for target in targets if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(name, path.read_text(), path.name == "__init__.py", modules) for name, path in modules.items()
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; the components of more than one module are the circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph[node]):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path back to the component's first module, for the failure message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    return component


def test_every_kind_of_import_is_an_edge():
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.sub", "p.sub.f"}
    source = """
from typing import TYPE_CHECKING
import p.a
from p import b
from .sub import f
from . import c as renamed
if TYPE_CHECKING:
    from p.d import Thing
def later():
    from p.e import other
import torch
"""
    assert _imports("p.x", source, False, modules) == {"p.a", "p.b", "p.sub.f", "p.c", "p.d", "p.e"}
    assert _imports("p.sub", "from . import f\nfrom .. import a", True, modules) == {"p.sub.f", "p.a"}
    assert _imports("p.x", "from p import Name", False, modules) == {"p"}
    graph = import_graph()
    assert "orcaserve.kernels.dispatch" in graph["orcaserve.kernels.linear"]
    assert "orcaserve.kernels.triton.backend" in graph["orcaserve.kernels.backends"]


def test_no_import_circle():
    graph = import_graph()
    circles = [
        component
        for component in strongly_connected(graph)
        if not any(expected >= set(component) for expected in EXPECTED_CYCLES)
    ]
    message = "\n".join(" -> ".join(_one_circle(graph, component)) for component in circles)
    assert not circles, f"import circles:\n{message}"
