"""The package's layers, read from its source: the core imports nothing above it, and nothing
outside the checkpoint store touches the store's private members.

The layers, lowest first: the checkpoint core (``nbresume/checkpoint/``, with the leaf modules
``errors`` and ``knobs``), the platforms (``nbresume/platforms/``), then what users run (the
notebook panel, Kaggle, the CLI, ``run``, ``slurm``, ...). A module may import from its own
layer and the ones below, never above. The checks parse every module with :mod:`ast` (imports
inside functions count too); nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "nbresume"

#: What a module under ``checkpoint/`` must never import: everything above the core.
ABOVE_THE_CORE = (
    "nbresume.platforms",
    "nbresume.slurm",
    "nbresume.run",
    "nbresume.notebook",
    "nbresume.kaggle",
    "nbresume.cli",
    "nbresume.preflight",
    "nbresume.runner",
    "nbresume.pull",
    "nbresume.demo",
)

#: The checkpoint store's own modules: the only ones that may use its private members.
STORE_MODULES = frozenset(
    {
        "nbresume.checkpoint.store",
        "nbresume.checkpoint.pending",
        "nbresume.checkpoint.reading",
        "nbresume.checkpoint.hashing",
        "nbresume.checkpoint.info",
    }
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), path, ast.parse(path.read_text(), filename=str(path))


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported(name: str, path: Path, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for every import of ``tree``; ``from nbresume import x`` is the
    submodule ``nbresume.x`` where there is one, else ``nbresume`` itself."""
    package = name if is_package(path) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                where = PACKAGE.parent / Path(*sub.split("."))
                is_module = where.with_suffix(".py").exists() or where.is_dir()
                yield node.lineno, sub if is_module else base


def upward_imports() -> list[str]:
    found = []
    for name, path, tree in modules():
        if not name.startswith("nbresume.checkpoint"):
            continue
        for line, target in imported(name, path, tree):
            above = target == "nbresume" or any(
                target == top or target.startswith(top + ".") for top in ABOVE_THE_CORE
            )
            if above:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    return found


#: The store's classes whose private members stay inside the store's modules.
STORE_CLASSES = ("CheckpointStore", "PendingCheckpoint")


def store_classes() -> dict[str, ast.ClassDef]:
    """The store's classes (:data:`STORE_CLASSES`) as parsed from the store's modules."""
    found = {}
    for name, _, tree in modules():
        if name in STORE_MODULES:
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name in STORE_CLASSES:
                    found[node.name] = node
    return found


def own_members(tree: ast.AST) -> set[str]:
    """The private methods defined and the private attributes set on ``self`` in ``tree``."""
    members: set[str] = set()
    for item in ast.walk(tree):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
        elif (
            isinstance(item, ast.Attribute)
            and isinstance(item.value, ast.Name)
            and item.value.id == "self"
            and isinstance(item.ctx, ast.Store)
        ):
            members.add(item.attr)
    return {m for m in members if m.startswith("_") and not m.startswith("__")}


def store_private_members() -> set[str]:
    """The private members of the store's classes, less the names that a class outside the
    store defines for itself too (``lease._state`` is the lease's own): read by name alone,
    those could not be told apart."""
    members: set[str] = set()
    for node in store_classes().values():
        members |= own_members(node)
    for name, _, tree in modules():
        if name not in STORE_MODULES:
            members -= own_members(tree)
    return members


def private_uses(members: set[str]) -> list[str]:
    """``<something>.<private member of CheckpointStore>`` outside the store's modules; a
    class's own ``self._x`` is its own member, whatever it is called."""
    found = []
    for name, path, tree in modules():
        if name in STORE_MODULES:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in members:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses "
                f"{ast.unparse(node.value)}.{node.attr}"
            )
    return found


def test_the_core_imports_nothing_above_it() -> None:
    found = upward_imports()
    assert not found, "the checkpoint core imports a layer above it:\n" + "\n".join(found)


def test_the_store_classes_are_where_the_test_looks() -> None:
    # Guards the next test: were a store class moved out of STORE_MODULES, that test would
    # pass without looking at it.
    missing = set(STORE_CLASSES) - set(store_classes())
    assert not missing, f"{sorted(missing)} not defined in any of {sorted(STORE_MODULES)}"


def test_no_module_outside_the_store_uses_its_private_members() -> None:
    found = private_uses(store_private_members())
    problem = "private members of the checkpoint store used outside it"
    assert not found, problem + ":\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from nbresume.platforms import detect", "nbresume.platforms"),
        ("import nbresume.slurm", "nbresume.slurm"),
        ("from nbresume import knobs", "nbresume.knobs"),
        ("from nbresume import __version__", "nbresume"),
        ("from ..platforms import drive", "nbresume.platforms.drive"),
    ],
)
def test_imports_are_read_the_way_python_resolves_them(source: str, expected: str) -> None:
    path = PACKAGE / "checkpoint" / "example.py"
    targets = [t for _, t in imported("nbresume.checkpoint.example", path, ast.parse(source))]
    assert targets == [expected]
