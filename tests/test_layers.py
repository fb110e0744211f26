"""The package's layers, read from its source: each layer imports only itself and the layers
below it, and nothing outside the checkpoint store touches the store's private members.

The layers, lowest first: the checkpoint core (``nbresume/checkpoint/``, with the leaf modules
``errors`` and ``knobs``), the platforms (``nbresume/platforms/``), then what users run (the
notebook panel, Kaggle, the CLI, ``run``, ``slurm``, ...). Inside the core, lowest first: its
root modules (``arguments``, ``events``, ``forksafe``, ``hooks``, ``procfs``, ``units``,
``version``), then the packages ``format``, ``backends``, ``store``, ``state``, ``parallel`` and
``loop`` (:data:`CORE_LAYERS`). A module may import from its own layer and the ones below, never
above; the rest of the package imports a layer of the core through its package, never its inner
modules.

The rules are stated once, for import-linter, in ``pyproject.toml`` (``[tool.importlinter]``),
and :func:`test_import_linter_keeps_every_contract` runs it. The checks below parse every module
with :mod:`ast` (imports inside functions and under ``TYPE_CHECKING`` count too; nothing is
imported) and say the same where import-linter is not installed, and more: no circle, no import
of the core inside a function, no private member of the store or the Checkpointer used outside
it, no ``isinstance`` on a concrete backend.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from testkit.paths import ROOT

PACKAGE = ROOT / "src" / "nbresume"

#: The layers of the checkpoint core, lowest first: the root's own modules (``None``), then its
#: packages. A module of the core belongs to the package it is in, or to the root.
CORE_LAYERS: tuple[str | None, ...] = (
    None,
    "format",
    "backends",
    "store",
    "state",
    "parallel",
    "loop",
)

#: What a module under ``checkpoint/`` must never import: everything above the core.
ABOVE_THE_CORE = (
    "nbresume.platforms",
    "nbresume.slurm",
    "nbresume.run",
    "nbresume.notebook",
    "nbresume.kaggle",
    "nbresume.cli",
    "nbresume.preflight_checks",
    "nbresume.runner",
    "nbresume.pull",
    "nbresume.demo",
)

#: The checkpoint store's own modules: the only ones that may use its private members.
STORE_MODULES = frozenset(
    {
        "nbresume.checkpoint.store.store",
        "nbresume.checkpoint.store.pending",
        "nbresume.checkpoint.store.reading",
        "nbresume.checkpoint.store.hashing",
        "nbresume.checkpoint.store.info",
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


def core_layer(name: str) -> int | None:
    """The rank of the core's layer that module ``name`` belongs to (:data:`CORE_LAYERS`), or
    ``None`` outside the core."""
    parts = name.split(".")
    if parts[:2] != ["nbresume", "checkpoint"]:
        return None
    if len(parts) > 2 and parts[2] in CORE_LAYERS:
        return CORE_LAYERS.index(parts[2])
    return 0


def is_inner_module(target: str) -> bool:
    """Whether ``target`` is a module inside one of the core's layer packages (not the package
    itself): what the rest of the package does not import."""
    parts = target.split(".")
    return parts[:2] == ["nbresume", "checkpoint"] and len(parts) > 3 and parts[2] in CORE_LAYERS


def upward_imports(parsed: Iterable[tuple[str, Path, ast.Module]]) -> list[str]:
    """The imports of ``parsed`` modules that go up: from the core to a layer above it, from a
    layer of the core to a higher one."""
    found = []
    for name, path, tree in parsed:
        rank = core_layer(name)
        if rank is None:
            continue
        for line, target in imported(name, path, tree):
            above = target == "nbresume" or any(
                target == top or target.startswith(top + ".") for top in ABOVE_THE_CORE
            )
            target_rank = core_layer(target)
            if above or (target_rank is not None and target_rank > rank):
                found.append(f"{where(path)}:{line} imports {target}")
    return found


def inner_imports(parsed: Iterable[tuple[str, Path, ast.Module]]) -> list[str]:
    """The imports of an inner module of a core layer from outside the core."""
    found = []
    for name, path, tree in parsed:
        if core_layer(name) is not None:
            continue
        for line, target in imported(name, path, tree):
            if is_inner_module(target):
                found.append(f"{where(path)}:{line} imports {target}")
    return found


def where(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


#: The store's classes whose private members stay inside the store's modules.
STORE_CLASSES = ("CheckpointStore", "PendingCheckpoint")


def classes_in(modules_of: frozenset[str], names: tuple[str, ...]) -> dict[str, ast.ClassDef]:
    """The classes ``names`` as parsed from the modules ``modules_of``."""
    found = {}
    for name, _, tree in modules():
        if name in modules_of:
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name in names:
                    found[node.name] = node
    return found


def store_classes() -> dict[str, ast.ClassDef]:
    """The store's classes (:data:`STORE_CLASSES`) as parsed from the store's modules."""
    return classes_in(STORE_MODULES, STORE_CLASSES)


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


def private_members(classes: dict[str, ast.ClassDef], own: frozenset[str]) -> set[str]:
    """The private members of ``classes``, less the names that a class outside the modules
    ``own`` defines for itself too (``lease._state`` is the lease's own): read by name alone,
    those could not be told apart."""
    members: set[str] = set()
    for node in classes.values():
        members |= own_members(node)
    for name, _, tree in modules():
        if name not in own:
            members -= own_members(tree)
    return members


def store_private_members() -> set[str]:
    return private_members(store_classes(), STORE_MODULES)


def private_uses(members: set[str], own: frozenset[str] = STORE_MODULES) -> list[str]:
    """``<something>.<private member>`` outside the modules ``own``; a class's own
    ``self._x`` is its own member, whatever it is called."""
    found = []
    for name, path, tree in modules():
        if name in own:
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


#: The Checkpointer's own modules (the epoch loop is a part of it), the only ones that may
#: use its private members; a strategy gets a small host object instead.
CHECKPOINTER_MODULES = frozenset(
    {"nbresume.checkpoint.loop.checkpointer", "nbresume.checkpoint.loop.epochloop"}
)


def test_the_core_imports_nothing_above_it() -> None:
    found = upward_imports(modules())
    assert not found, "the checkpoint core imports a layer above it:\n" + "\n".join(found)


def test_the_rest_imports_the_core_through_its_layer_packages() -> None:
    found = inner_imports(modules())
    problem = "modules outside the core import an inner module of a layer"
    assert not found, problem + " (import the layer's package):\n" + "\n".join(found)


def parse(name: str, source: str) -> tuple[str, Path, ast.Module]:
    """A module ``name`` made of ``source``, as :func:`modules` gives one."""
    path = PACKAGE.parent / Path(*name.split(".")).with_suffix(".py")
    return name, path, ast.parse(source)


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("nbresume.checkpoint.format.manifest", "from nbresume.checkpoint.store import reading"),
        ("nbresume.checkpoint.units", "from nbresume.checkpoint.format import Manifest"),
        ("nbresume.checkpoint.store.store", "from nbresume.checkpoint.loop import Checkpointer"),
        ("nbresume.checkpoint.state.data", "from nbresume.checkpoint.loop.health import DataWait"),
        ("nbresume.checkpoint.store.info", "from nbresume.platforms import detect"),
        ("nbresume.checkpoint.backends.base", "from nbresume import __version__"),
    ],
)
def test_an_upward_import_is_found(name: str, source: str) -> None:
    assert upward_imports([parse(name, source)])


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("nbresume.checkpoint.loop.cadence", "from nbresume.checkpoint.format import Manifest"),
        ("nbresume.checkpoint.store.store", "from nbresume.checkpoint.store import reading"),
        ("nbresume.checkpoint.format.manifest", "from nbresume.checkpoint import units"),
        ("nbresume.checkpoint.state.data", "from nbresume import knobs"),
    ],
)
def test_an_import_of_the_same_or_a_lower_layer_is_not(name: str, source: str) -> None:
    assert upward_imports([parse(name, source)]) == []


def test_an_inner_module_imported_from_outside_the_core_is_found() -> None:
    inner = parse("nbresume.cli", "from nbresume.checkpoint.store.store import CheckpointStore")
    package = parse("nbresume.cli", "from nbresume.checkpoint.store import CheckpointStore")
    root = parse("nbresume.cli", "from nbresume.checkpoint.units import format_bytes")
    core = parse("nbresume.checkpoint.loop.saver", "from nbresume.checkpoint.store import info")
    assert inner_imports([inner])
    assert inner_imports([package, root, core]) == []


def test_the_store_classes_are_where_the_test_looks() -> None:
    # Guards the next test: were a store class moved out of STORE_MODULES, that test would
    # pass without looking at it.
    missing = set(STORE_CLASSES) - set(store_classes())
    assert not missing, f"{sorted(missing)} not defined in any of {sorted(STORE_MODULES)}"


def test_no_module_outside_the_store_uses_its_private_members() -> None:
    found = private_uses(store_private_members())
    problem = "private members of the checkpoint store used outside it"
    assert not found, problem + ":\n" + "\n".join(found)


def test_no_module_outside_the_checkpointer_uses_its_private_members() -> None:
    classes = classes_in(CHECKPOINTER_MODULES, ("Checkpointer", "Epochs"))
    assert set(classes) == {"Checkpointer", "Epochs"}
    found = private_uses(private_members(classes, CHECKPOINTER_MODULES), CHECKPOINTER_MODULES)
    problem = "private members of the Checkpointer used outside it"
    assert not found, problem + ":\n" + "\n".join(found)


#: The backends' modules, the only ones that may use a backend's private members.
BACKEND_MODULES = frozenset(
    name for name, _, _ in modules() if name.startswith("nbresume.checkpoint.backends")
)
BACKEND_CLASSES = ("Backend", "LocalStore", "FsspecStore", "DriveStore", "DriveApi")


def test_no_module_outside_the_backends_uses_their_private_members() -> None:
    classes = classes_in(BACKEND_MODULES, BACKEND_CLASSES)
    assert set(classes) == set(BACKEND_CLASSES)
    members = private_members(classes, BACKEND_MODULES)
    assert "_check_writer" in members  # what the check looks for is there to find
    found = private_uses(members, BACKEND_MODULES)
    problem = "private members of a backend used outside the backends"
    assert not found, problem + ":\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from nbresume.platforms import detect", "nbresume.platforms"),
        ("import nbresume.slurm", "nbresume.slurm"),
        ("from nbresume import knobs", "nbresume.knobs"),
        ("from nbresume import __version__", "nbresume"),
        ("from ..platforms import drive", "nbresume.platforms.drive"),
        ("from nbresume.checkpoint.store import reading", "nbresume.checkpoint.store.reading"),
        ("from nbresume.checkpoint.store import CheckpointStore", "nbresume.checkpoint.store"),
        ("from .store import pending", "nbresume.checkpoint.store.pending"),
    ],
)
def test_imports_are_read_the_way_python_resolves_them(source: str, expected: str) -> None:
    path = PACKAGE / "checkpoint" / "example.py"
    targets = [t for _, t in imported("nbresume.checkpoint.example", path, ast.parse(source))]
    assert targets == [expected]


def core_imports() -> dict[str, set[str]]:
    """Every module of the core and the core modules it imports, at any place in it (module
    level, inside a function, under ``TYPE_CHECKING``)."""
    graph: dict[str, set[str]] = {}
    for name, path, tree in modules():
        if name.startswith("nbresume.checkpoint"):
            graph[name] = {
                target
                for _, target in imported(name, path, tree)
                if target.startswith("nbresume.checkpoint.") and target != name
            }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_core_has_no_import_circle() -> None:
    """Counting every import: module level, inside functions and under ``TYPE_CHECKING``."""
    assert circles(core_imports()) == []


def package_imports() -> dict[str, set[str]]:
    """Every module of the package and the package's modules it imports, at any place in it;
    ``from nbresume.x import name`` is an edge to ``nbresume.x`` (the module that runs)."""
    names = {name for name, _, _ in modules()}

    def module_of(target: str) -> str:
        while target and target not in names:
            target = target.rpartition(".")[0]
        return target

    graph: dict[str, set[str]] = {}
    for name, path, tree in modules():
        targets = {module_of(t) for _, t in imported(name, path, tree) if t.startswith("nbresume")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_the_package_has_no_import_circle() -> None:
    """Beyond the core too: the notebook layer, the CLI, the frameworks, Kaggle's commands. A
    lower module reaches a higher one through a value handed to it (``run.provide_display``),
    never by importing it, even inside a function."""
    assert circles(package_imports()) == []


def test_the_circle_finder_finds_a_circle_and_nothing_else() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_its_own_modules_at_module_level() -> None:
    """An import of a core module inside a function hides an edge from readers and tools."""
    found = []
    for name, path, tree in modules():
        if not name.startswith("nbresume.checkpoint"):
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nbresume"):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "core modules imported inside functions:\n" + "\n".join(found)


CONCRETE_BACKENDS = ("LocalStore", "FsspecStore", "DriveStore")


def test_only_the_backends_ask_which_backend_a_store_is() -> None:
    """The core asks the backend protocol (``local_path()``, ``confirm()``,
    ``make_durable()``, ``write_back``), never which concrete backend a store has: no
    ``isinstance`` on one, no ``type(...) is`` one, outside ``backends/``."""
    found = []
    for name, path, tree in modules():
        if not name.startswith("nbresume.checkpoint") or ".backends" in name:
            continue
        for node in ast.walk(tree):
            asks = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
                and any(backend in ast.unparse(node.args[1]) for backend in CONCRETE_BACKENDS)
            ) or (
                isinstance(node, ast.Compare)
                and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops)
                and "type(" in ast.unparse(node)
                and any(backend in ast.unparse(node) for backend in CONCRETE_BACKENDS)
            )
            if asks:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "a concrete backend asked for in the core:\n" + "\n".join(found)


def documented_save_path() -> tuple[list[str], int]:
    """The modules docs/architecture.md says one blocking save enters, and their count."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("The modules one blocking save enters")
    paragraph = text[start : text.index("\n\n", start)]
    listed = paragraph[paragraph.index("against it):") : paragraph.index(" modules.")]
    count = re.search(r": (\d+)$", listed)
    assert count, "the count of modules is not where the test looks"
    return re.findall(r"`([\w/]+\.py)`", listed), int(count.group(1))


def test_the_life_of_one_save_lists_the_modules_a_save_enters() -> None:
    """docs/architecture.md lists what ``python -m benchmarks.save_path`` traces."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.save_path"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *traced, total = proc.stdout.splitlines()
    listed, count = documented_save_path()
    assert total == f"{len(traced)} modules"
    assert sorted(listed) == sorted(traced), "docs/architecture.md lists other modules"
    assert count == len(traced)


#: The modules of a training loop's machinery, which talk to each other through public members.
LOOP_MODULES = [
    *sorted((PACKAGE / "checkpoint" / "loop").glob("*.py")),
    PACKAGE / "checkpoint" / "state" / "data.py",
    PACKAGE / "frameworks" / "watch.py",
]


def _private_uses(path: Path) -> list[str]:
    """``other._member`` in ``path``, where ``other`` is not the object itself (``self``,
    ``cls``, ``super()``) nor a module of the standard library (``os._exit``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in {"self", "cls", "os", "sys"}:
            continue
        if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
            continue
        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_loop_machinery_uses_no_private_member_of_another_object() -> None:
    found = [use for path in LOOP_MODULES for use in _private_uses(path)]
    assert not found, "use a public member or hand over a value:\n" + "\n".join(found)


def test_no_protocol_has_a_private_member() -> None:
    """A Protocol is a promise between two objects: made of what each shows the other."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any(ast.unparse(base).endswith("Protocol") for base in node.bases):
                continue
            for member in node.body:
                names = []
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = [member.name]
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    names = [member.target.id]
                found += [
                    f"{path.relative_to(PACKAGE.parent)}: {node.name}.{name}"
                    for name in names
                    if name.startswith("_") and not name.startswith("__")
                ]
    assert not found, "\n".join(found)


def test_the_notebook_reads_a_running_loop_by_its_typed_members() -> None:
    """The panel, the magics and the status line read a loop through ``RunningLoop``."""
    loops = {"ckpt", "checkpointer", "loop", "watch"}
    found = []
    for path in sorted((PACKAGE / "notebook").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "hasattr"}
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in loops
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "\n".join(found)


def test_the_checkpointer_keeps_few_attributes_of_its_own() -> None:
    """What decides when to save and stop lives in its LoopControl, what a strategy needs in
    its host: the Checkpointer itself stays small enough to read (25 attributes at most)."""
    tree = ast.parse((PACKAGE / "checkpoint" / "loop" / "checkpointer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer"]
    names = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(each, ast.Attribute) and ast.unparse(each.value) == "self":
                    names.add(each.attr)
    assert len(names) <= 25, sorted(names)
