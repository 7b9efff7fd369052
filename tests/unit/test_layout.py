"""The package's layout: imports between its subpackages flow one way (no circle)."""

import ast
import collections
from pathlib import Path

import elastic_trainer

ROOT = Path(elastic_trainer.__file__).parent


def _unit_imports() -> dict[str, set[str]]:
    """Top-level unit (subpackage or module) -> the units it imports, lazy imports included."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("").parts
        pkg = list(rel[:-1]) if path.name == "__init__.py" else list(rel[:-1])
        unit = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg[:len(pkg) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elastic_trainer."):
                target = node.module.split(".")
            else:
                continue
            if len(target) > 1 and target[1] != unit:
                edges[unit].add(target[1])
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u):
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        path.pop()
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_the_subpackages_import_each_other_without_a_circle():
    edges = _unit_imports()
    assert {"controller", "trainer", "cli", "reporting"} <= set(edges)   # the scan read the package
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_layers_below_never_import_those_above():
    edges = _unit_imports()
    # What a step is made of runs without the run's machinery, and the runtime without its front ends.
    for low in ("config", "parallel", "comm", "checkpoint", "data", "models", "metrics", "worker", "planning"):
        assert not edges.get(low, set()) & {"controller", "trainer", "cli", "reporting", "chaos"}, (low, edges[low])
    assert not edges["controller"] & {"trainer", "cli", "reporting", "chaos"}, edges["controller"]
    assert "cli" not in edges["trainer"] and "chaos" not in edges["trainer"]


def test_the_scan_sees_a_circle_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
