"""The shape of the package: the pipeline's stages in order, one idea per file, short
functions, complete ``__all__``s, and ``docs/architecture.md`` naming every file.

These read the source; they check the rules of docs/architecture.md, so that a change that
breaks one fails here rather than in review.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import autoremat

SRC = Path(autoremat.__file__).parent
ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"
MAX_FUNCTION_LINES = 60  # signature, docstring and body
# The stages, in the order data flows: each imports only from itself and those before it.
STAGES = (
    "core", "record", "costs", "wrap", "planning", "training", "picture", "integrations",
    "comparison", "examples", "cli",
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def imported(tree: ast.Module, name: str) -> dict[str, set[str]]:
    """The autoremat modules a module imports (anywhere in its code, ``TYPE_CHECKING`` blocks
    included), each with the names taken from it (empty for ``import x`` / a submodule)."""
    found: dict[str, set[str]] = {}
    package = name if name in PACKAGES else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("autoremat"):
                    found.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if not module.startswith("autoremat"):
                continue
            for a in node.names:
                if f"{module}.{a.name}" in SOURCES:
                    found.setdefault(f"{module}.{a.name}", set())
                else:
                    found.setdefault(module, set()).add(a.name)
    return {m: names for m, names in found.items() if m in SOURCES and m != name}


PACKAGES = {m for m in SOURCES if (SRC.parent / m.replace(".", "/") / "__init__.py").is_file()}
IMPORTS = {name: imported(tree, name) for name, tree in SOURCES.items()}


def stage(module: str) -> int | None:
    """The index of a module's stage in :data:`STAGES` (None: the top-level package)."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_is_in_a_stage():
    top = ("autoremat", "autoremat.__main__")
    loose = [m for m in SOURCES if stage(m) is None and m not in top]
    assert not loose, f"modules outside the stages {STAGES}: {loose}"


@pytest.mark.parametrize("name", sorted(m for m in SOURCES if stage(m) is not None))
def test_data_flows_one_way(name):
    """A stage imports only from itself and the stages before it (never from the package's
    top level, which is the public API made of them all)."""
    here = stage(name)
    assert here is not None
    later = [m for m in IMPORTS[name] if stage(m) is None or stage(m) > here]  # type: ignore[operator]
    assert not later, f"{name} ({STAGES[here]}) imports from a later stage: {later}"


def test_no_import_cycles():
    """No module reaches itself through the modules it imports (function-local and
    ``TYPE_CHECKING`` imports included, so none of them hides a cycle)."""
    cycles = []
    for start in SOURCES:
        seen, todo = set(), list(IMPORTS[start])
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(IMPORTS[m])
    assert not cycles, f"modules in an import cycle: {cycles}"


def test_no_function_local_imports_of_autoremat():
    """Imports of the package sit at the top of a module, where the stage order is seen."""
    local = []
    for name, tree in SOURCES.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "autoremat"
                    ):
                        local.append(f"{name}.{fn.name}: from {node.module}")
                    elif isinstance(node, ast.Import) and any(
                        a.name.startswith("autoremat") for a in node.names
                    ):
                        local.append(f"{name}.{fn.name}: import")
    assert not local, local


def test_the_solver_is_pure():
    """The solver reads items and points: it imports nothing of autoremat, nor torch."""
    tree = SOURCES["autoremat.planning.solver"]
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n for n in names if n.startswith(("autoremat", "torch"))}


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, tree in SOURCES.items():
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
    for name, tree in SOURCES.items():
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
                and aliases.get(node.value.id, "") in SOURCES
            ):
                crossing.append(f"{name}: {node.value.id}.{node.attr}")
    assert not crossing, crossing


def declared(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return None


def test_every_module_says_what_it_offers_and_offers_what_others_take():
    """Each module with public names has ``__all__``; it lists every public function and
    class defined there and every name another module of the package imports from it, and
    each name it lists exists."""
    problems = []
    taken: dict[str, set[str]] = {}
    for imports in IMPORTS.values():
        for module, names in imports.items():
            taken.setdefault(module, set()).update(names)
    for name, tree in SOURCES.items():
        if name == "autoremat.__main__":
            continue
        defined = [
            n.name
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
        ]
        offered = declared(tree)
        if offered is None:
            if defined or taken.get(name):
                problems.append(f"{name}: no __all__")
            continue
        missing = (set(defined) | taken.get(name, set())) - set(offered)
        if missing:
            problems.append(f"{name}: __all__ lacks {sorted(missing)}")
        module = importlib.import_module(name)
        absent = [n for n in offered if not hasattr(module, n)]
        if absent:
            problems.append(f"{name}: __all__ names what it lacks: {absent}")
    assert not problems, problems


def test_no_name_shadows_a_module():
    """``autoremat.plan`` is the function and no module has that name (the same for every
    public name); in every package, a name that is also a submodule's is that submodule, so
    ``import autoremat.x.y`` and ``autoremat.x.y`` never disagree."""
    for name in autoremat.__all__:
        assert importlib.util.find_spec(f"autoremat.{name}") is None, name
    for package in sorted(PACKAGES):
        module = importlib.import_module(package)
        for info in pkgutil.iter_modules(module.__path__):
            value = getattr(module, info.name, None)
            assert value is None or value is importlib.import_module(f"{package}.{info.name}"), (
                f"{package}.{info.name} is a module, but {package} binds that name to {value!r}"
            )


def test_every_logger_is_named_for_its_module():
    """``logging.getLogger(__name__)``: a user silences or raises one part by its name, and
    nothing filters log records by their text."""
    fixed = []
    for name, tree in SOURCES.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")
                and name != "autoremat.cli.commands"  # the command line's stderr handler
            ):
                fixed.append(name)
    assert not fixed, fixed


def test_the_architecture_page_names_every_file_and_only_files_that_exist():
    text = ARCHITECTURE.read_text()
    files = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(f for f in files if f"`{f}`" not in text)
    assert not missing, f"docs/architecture.md does not name {missing}"
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    named = {f for f in named if not f.startswith(("benchmarks/", "tests/"))}
    gone = sorted(f for f in named if not (SRC / f).is_file())
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def test_the_package_is_typed():
    assert (SRC / "py.typed").is_file()
