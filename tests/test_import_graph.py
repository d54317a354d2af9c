"""The package's import graph, read from the source with ``ast`` (nothing is imported).

Three rules (docs/INTERFACES.md, "Layout"): no import cycle between treeserve modules (type-only
imports included), no module importing a private (``_x``) module of a package it is not inside,
and imports pointing down the layers: kvcache and sampling import no other subpackage, models
and scheduler none above them, runner nothing from the engine or the front ends, nothing below
the cluster (replicas on Ray Serve) imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "treeserve"

# Subpackages (and top-level modules) each layer must not import; a package missing here is free.
FORBIDDEN: dict[str, set[str]] = {
    "kvcache": {"sampling", "models", "scheduler", "runner", "engine", "output", "server", "cli", "bench", "cluster"},
    "sampling": {"kvcache", "models", "scheduler", "runner", "engine", "output", "server", "cli", "bench", "cluster"},
    "models": {"scheduler", "runner", "engine", "output", "server", "cli", "bench", "cluster"},
    "scheduler": {"models", "runner", "engine", "server", "cli", "bench", "cluster"},
    "runner": {"engine", "output", "server", "cli", "bench", "cluster"},
    "distributed": {"engine", "server", "cli", "cluster"},
    "engine": {"server", "cli", "cluster"},
    "server": {"cluster", "cli"},  # the replicas (cluster) sit above the server
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """treeserve modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for root in sorted(edges):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(edges[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges[child]))))
    return None


def private_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            parts = dst.split(".")
            for i, part in enumerate(parts):
                owner = ".".join(parts[:i])
                if part.startswith("_") and not part.startswith("__") and not (src + ".").startswith(owner + "."):
                    bad.append((src, dst))
    return bad


def layer_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for src, targets in edges.items():
        layer = src.split(".")[1] if "." in src else ""
        for dst in targets:
            top = dst.split(".")[1] if "." in dst else ""
            if top in FORBIDDEN.get(layer, set()):
                bad.append((src, dst))
    return bad


def test_no_import_cycles() -> None:
    assert find_cycle(graph()) is None


def test_no_private_module_of_another_package() -> None:
    assert private_violations(graph()) == []


def test_imports_point_down_the_layers() -> None:
    assert layer_violations(graph()) == []


def test_every_subpackage_has_a_layer() -> None:
    """The rules above must see the package (a renamed layer would silently escape them)."""
    tops = {name.split(".")[1] for name in all_modules() if name.count(".") >= 1}
    assert set(FORBIDDEN) <= tops


@pytest.mark.parametrize(
    ("edges", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, None),
        ({"a": {"a"}}, ["a", "a"]),
    ],
)
def test_cycle_finder(edges: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(edges) == cycle


def test_rule_checkers_catch_violations() -> None:
    edges = {
        "treeserve.kvcache.pool": {"treeserve.runner.eager"},
        "treeserve.runner.graph": {"treeserve.kvcache._backend", "treeserve._utils"},
        "treeserve.kvcache.ops": {"treeserve.kvcache._checks"},
    }
    assert layer_violations(edges) == [("treeserve.kvcache.pool", "treeserve.runner.eager")]
    assert private_violations(edges) == [("treeserve.runner.graph", "treeserve.kvcache._backend")]
