"""The shape of the package: data flows one way, one idea per file, short functions.

These read the source; they check the rules of docs/architecture.md, so that a change that
breaks one fails here rather than in review.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import autoremat

SRC = Path(autoremat.__file__).parent
MAX_FUNCTION_LINES = 60  # signature, docstring and body


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def imports(tree: ast.Module, name: str) -> set[str]:
    """The autoremat modules a module imports (at any depth in its code)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("autoremat"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoremat"):
            found.add(node.module)  # type: ignore[arg-type]
            found.update(f"{node.module}.{a.name}" for a in node.names)
    modules = set(sources_cache)
    return {m for m in found if m in modules and m != name}


sources_cache = sources()


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        for dep in imports(sources_cache[name], name):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


MEASUREMENT = [m for m in sources_cache if m.startswith("autoremat.costs")] + [
    "autoremat.measurement",
    "autoremat.memory",
]
PLANNING = {
    "autoremat.solver",
    "autoremat.planning_tree",
    "autoremat.strategies",
    "autoremat.strategies.budget",
    "autoremat.strategies.levels",
    "autoremat.planner",
    "autoremat.plans",
    "autoremat.wrap",
}


@pytest.mark.parametrize("name", MEASUREMENT)
def test_measurement_never_imports_the_solver_the_plan_or_the_wrap(name):
    assert not reachable(name) & PLANNING, sorted(reachable(name) & PLANNING)


def test_the_solver_is_pure():
    """The solver reads items and points: it imports nothing of autoremat, nor torch."""
    tree = sources_cache["autoremat.solver"]
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n for n in names if n.startswith(("autoremat", "torch"))}


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, tree in sources_cache.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_no_private_name_crosses_modules():
    """``from autoremat.x import _y`` and ``x._y`` on an autoremat module are not used: what
    another module needs is public."""
    crossing = []
    for name, tree in sources_cache.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoremat"):
                for a in node.names:
                    if a.name.startswith("_"):
                        crossing.append(f"{name}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("autoremat"):
                        aliases[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, "") in sources_cache
            ):
                crossing.append(f"{name}: {node.value.id}.{node.attr}")
    assert not crossing, crossing


def test_public_functions_do_not_shadow_modules():
    """``autoremat.plan`` is the function and no module has that name (the same for every
    public name), so ``import autoremat.X`` never surprises."""
    for name in autoremat.__all__:
        assert importlib.util.find_spec(f"autoremat.{name}") is None, name


def test_every_module_with_public_names_says_which():
    missing = []
    for name, tree in sources_cache.items():
        public = [
            n.name
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
        ]
        assigned = {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        if public and "__all__" not in assigned and name not in ("autoremat.__main__",):
            missing.append(name)
    assert not missing, missing


def test_the_package_is_typed():
    assert (SRC / "py.typed").is_file()
