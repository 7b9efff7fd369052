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
    for low in ("storage", "config", "parallel", "comm", "checkpoint", "data", "models", "integrity", "metrics",
                "worker", "planning"):
        assert not edges.get(low, set()) & {"controller", "trainer", "cli", "reporting", "chaos"}, (low, edges[low])
    assert not edges["controller"] & {"trainer", "cli", "reporting", "chaos"}, edges["controller"]
    assert "cli" not in edges["trainer"] and "chaos" not in edges["trainer"]


def test_the_scan_sees_a_circle_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _module_imports(package: Path) -> dict[str, set[str]]:
    """Module of ``package`` and its subpackages (dotted, below ``package``) -> the modules of the
    same package it imports (relative imports, lazy ones included)."""
    edges: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).with_suffix("").parts
        here = list(rel[:-1])
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                if node.level - 1 > len(here):
                    continue   # above the package
                base = here[:len(here) - node.level + 1]
                found.add(".".join(base + node.module.split(".")))
        edges[".".join(rel)] = found
    return edges


def _folder_imports(package: Path) -> dict[str, set[str]]:
    """Subpackage of ``package`` -> the other subpackages it imports (modules at its top: ``.``)."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for mod, targets in _module_imports(package).items():
        folder = mod.split(".")[0] if "." in mod else "."
        for t in targets:
            other = t.split(".")[0] if "." in t else "."
            if other != folder:
                out[folder].add(other)
    return out


def test_only_the_assembling_module_knows_the_controller_and_its_parts_form_no_circle():
    controller = ROOT / "controller"
    users = []
    for path in ROOT.rglob("*.py"):
        if path == controller / "controller.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Controller" for a in node.names):
                users.append(str(path.relative_to(ROOT)))
            # A part given the controller itself (a parameter named or typed so) would be one too.
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args:
                    hint = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg == "ctl" or "Controller" in hint.replace("ControllerQueries", ""):
                        users.append(f"{path.relative_to(ROOT)}:{node.name}({arg.arg})")
    assert not users, users
    edges = _module_imports(controller)
    assert {"failures.recovery", "step_loop", "run.run_record", "replanning.plan_setup"} <= set(edges)
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))
    # Nothing hides a circle behind TYPE_CHECKING.
    hidden = [p.name for p in controller.rglob("*.py") if "TYPE_CHECKING" in p.read_text()]
    assert not hidden, hidden


def test_the_controllers_rooms_import_downward_only():
    # The folders of controller/ (failures, replanning, state, stepping, balance, and run, the
    # run's record and worker pool beneath them all) form no circle; only the modules at the
    # top (the controller, its step loop, its queries) assemble them.
    folders = _folder_imports(ROOT / "controller")
    assert {"failures", "replanning", "state", "stepping", "balance", "run"} <= set(folders) | {"run"}
    assert _cycle(dict(folders)) is None, " -> ".join(_cycle(dict(folders)))
    assert not folders["run"], folders["run"]
    for room, imports in folders.items():
        if room != ".":
            assert "." not in imports, (room, imports)
    # A room of more than about 15 modules hides its concerns.
    for room in (ROOT / "controller").iterdir():
        if room.is_dir() and room.name != "__pycache__":
            assert len([p for p in room.glob("*.py") if p.name != "__init__.py"]) <= 15, room.name
