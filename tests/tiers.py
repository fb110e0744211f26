"""The suite's two tiers: tests that start a process (marked ``proc``) and tests that run in
pytest's own process (``python -m pytest -m "not proc"``, the fast tier).

The mark is given at collection, from what a test reaches: its own code, its fixtures' code
and the test helpers they call, read for the names that start a process (``subprocess``,
``multiprocessing``, ``sys.executable``, papermill, ...). A module can also say it outright
(``pytestmark = pytest.mark.proc``) where what starts the process is inside nbresume (a
DataLoader with workers, ``nbresume check``).

What the reading misses, the run catches: every test that is not marked ``proc`` runs with
the process-starting calls of ``os`` and ``subprocess`` watched, and a test that starts a
process anyway fails, naming the call and the mark to add. So the fast tier is honestly
in-process, and a new test that starts a process cannot slip into it.
"""

from __future__ import annotations

import dis
import inspect
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent


class Suite:
    """The suite's own files, whose helpers are followed: its ``tests`` folder (set when
    pytest starts, from its root)."""

    root = TESTS


#: Names whose use in a test, a fixture or a helper means a process is started.
STARTS_A_PROCESS = frozenset(
    {
        "subprocess",
        "Popen",
        "multiprocessing",
        "ProcessPoolExecutor",
        "papermill",
        "execute_notebook",
        "executable",  # sys.executable: a Python child
        "fork",
        "posix_spawn",
        "spawnv",
        "system",  # os.system
        "popen",
        "pexpect",
        "torchrun",
        "warmfork",  # testkit.warmfork: a child forked from the suite's warm server
    }
)


def starts_processes(obj: Any) -> Any:
    """Say of a fixture, a helper or a class of the suite that using it starts processes,
    where its code does not show it (it asks a warm fork server, or hands nbresume a program
    that nbresume runs)."""
    obj.__starts_processes__ = True
    return obj


def _suite_index() -> dict[str, list[Any]]:
    """The functions and classes of the suite's modules, by name: what a test imports inside
    a function is not among its globals."""
    index: dict[str, list[Any]] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not Path(file).resolve().is_relative_to(Suite.root):
            continue
        for name, value in vars(module).items():
            if (inspect.isfunction(value) or inspect.isclass(value)) and _is_ours(value):
                index.setdefault(name, []).append(value)
    return index


def _is_ours(obj: Any) -> bool:
    """A function or class defined in a file of the test suite (helpers are followed, the
    libraries under test are not: their processes are caught at run time)."""
    try:
        source = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return source is not None and Path(source).resolve().is_relative_to(Suite.root)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def reaches_a_process(
    obj: Any,
    seen: set[int] | None = None,
    depth: int = 6,
    index: dict[str, list[Any]] | None = None,
) -> bool:
    """Whether ``obj`` (a test, a fixture's function, a helper, a class of the suite) names a
    way to start a process, in its own code or in the suite's helpers it calls."""
    seen = set() if seen is None else seen
    obj = inspect.unwrap(obj)
    if id(obj) in seen or depth < 0:
        return False
    seen.add(id(obj))
    if getattr(obj, "__starts_processes__", False):
        return True
    if inspect.isclass(obj):
        return any(
            reaches_a_process(member, seen, depth - 1, index)
            for cls in inspect.getmro(obj)
            if _is_ours(cls)
            for member in vars(cls).values()
            if inspect.isfunction(member) and _is_ours(member)
        )
    code = getattr(obj, "__code__", None)
    if code is None:
        return False
    scope = getattr(obj, "__globals__", {})
    for each in _codes(code):
        names = set(each.co_names)
        if names & STARTS_A_PROCESS:
            return True
        imported = _imported_inside(each)
        for name in names:
            target = scope.get(name)
            if (inspect.isfunction(target) or inspect.isclass(target)) and _is_ours(target):
                targets = [target]
            elif name in imported:
                targets = (index or {}).get(name, [])
            else:
                continue
            if any(reaches_a_process(each, seen, depth - 1, index) for each in targets):
                return True
    return False


def _imported_inside(code: types.CodeType) -> set[str]:
    """The names a function imports in its body (``from helpers import start_server``)."""
    return {i.argval for i in dis.get_instructions(code) if i.opname == "IMPORT_FROM"}


def _fixtures_asked_by_name(obj: Any) -> Iterator[str]:
    """The names a test or fixture passes to ``request.getfixturevalue``."""
    code = getattr(inspect.unwrap(obj), "__code__", None)
    if code is None:
        return
    for each in _codes(code):
        if "getfixturevalue" in each.co_names:
            yield from (c for c in each.co_consts if isinstance(c, str) and c.isidentifier())


def _fixture_functions(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    """The functions of the fixtures a test uses, with those its fixtures ask for by name."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    manager = item.session._fixturemanager
    definitions = [d for ds in info.name2fixturedefs.values() for d in ds]
    done: set[str] = set()
    while definitions:
        definition = definitions.pop()
        if definition.argname in done:
            continue
        done.add(definition.argname)
        if not _is_ours(definition.func):
            continue
        yield definition.func
        for name in _fixtures_asked_by_name(definition.func):
            definitions.extend(manager.getfixturedefs(name, item) or ())


def starts_a_process(item: pytest.Item, index: dict[str, list[Any]]) -> bool:
    """Whether a collected test reaches a process, through its own code or its fixtures'."""
    function = getattr(item, "function", None)
    if function is not None and reaches_a_process(function, index=index):
        return True
    return any(reaches_a_process(func, index=index) for func in _fixture_functions(item))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    index = _suite_index()
    for item in items:
        if item.get_closest_marker("proc") is None and starts_a_process(item, index):
            item.add_marker(pytest.mark.proc)


# -- the watch at run time ------------------------------------------------------------------


class _Watch:
    """The process-starting calls made while an unmarked test runs."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[str] = []

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            if self.active and os.getpid() == self.pid:
                self.calls.append(name)
            return original(*args, **kwargs)

        watched.watched = True  # type: ignore[attr-defined]
        return watched

    pid = os.getpid()


WATCH = _Watch()


def _install() -> None:
    import _posixsubprocess

    for owner, name in (
        (os, "fork"),
        (os, "forkpty"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (_posixsubprocess, "fork_exec"),
        (subprocess, "_fork_exec"),
    ):
        original = getattr(owner, name, None)
        if original is not None and not getattr(original, "watched", False):
            setattr(owner, name, WATCH.wrap(f"{owner.__name__}.{name}", original))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "proc: starts a process (given at collection, tests/tiers.py); "
        '-m "not proc" runs the in-process tier',
    )
    tests = config.rootpath / "tests"
    Suite.root = (tests if tests.is_dir() else config.rootpath).resolve()
    WATCH.pid = os.getpid()
    _install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    watched = item.get_closest_marker("proc") is None
    WATCH.calls.clear()
    WATCH.active = watched
    try:
        return (yield)
    finally:
        WATCH.active = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    result = yield
    if WATCH.active and WATCH.calls:
        calls = ", ".join(sorted(set(WATCH.calls)))
        WATCH.calls.clear()
        pytest.fail(
            f"{item.nodeid} started a process ({calls}) but is not marked proc: add "
            "@pytest.mark.proc to it (or pytestmark = pytest.mark.proc to its module), so "
            'that the in-process tier (-m "not proc") stays in-process',
            pytrace=False,
        )
    return result


# -- the slowest tests, kept --------------------------------------------------------------------

#: Where a run leaves its slowest tests (what to look at first when the suite grows slow).
DURATIONS_FILE = TESTS.parent / "test-durations.txt"
SLOWEST = 30
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the slowest tests (setup, call and teardown together) of a run of the whole
    suite; a run of some tests only leaves the file of the last whole run alone."""
    config = session.config
    whole = (
        config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and config.option.markexpr == "not torture"
        and not config.option.keyword
        and not config.option.collectonly
    )
    if hasattr(config, "workerinput") or not whole:
        return
    slowest = sorted(_durations.items(), key=lambda item: -item[1])[:SLOWEST]
    lines = [f"{seconds:8.2f} s  {nodeid}" for nodeid, seconds in slowest]
    DURATIONS_FILE.write_text(
        f"# the {SLOWEST} slowest tests of the last run of the suite\n" + "\n".join(lines) + "\n"
    )
