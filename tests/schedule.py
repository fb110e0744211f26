"""How a run of the suite is spread over pytest-xdist's workers (``--dist loadfile``).

A run on two cores ends when its last worker ends: the work should be shared evenly, and the
longest pieces should not come last. The unit of work is a file (its tests share fixtures of
module scope: an expensive reference run, a server, a batch of checks started together, which
are then computed once), and the files run longest first, as far as collection can tell: a test
marked ``slow`` counts as :data:`SLOW_S`, one that starts a process (``proc``) as
:data:`PROC_S`, any other as :data:`IN_PROCESS_S`. ``--no-loadscope-reorder`` keeps that
order: xdist's own puts the files with the most tests first, and a file of two long tests then
ran last, alone, while the other worker had nothing left to do.

Run in one process (``-n 0``), the suite keeps its files' order.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import pytest

#: What a test is expected to take, in seconds, by its marks: only the order they give counts.
SLOW_S = 20.0
PROC_S = 3.0
IN_PROCESS_S = 0.05


def expected_seconds(item: pytest.Item) -> float:
    if item.get_closest_marker("slow") is not None:
        return SLOW_S
    if item.get_closest_marker("proc") is not None:
        return PROC_S
    return IN_PROCESS_S


def longest_first(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` file by file, the files expected to take longest first, each file's tests in
    their order. The sort is stable: files of equal cost keep the collection's order, the same
    on every worker (xdist checks that the workers collected the same list)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(files.values(), key=lambda tests: -sum(map(expected_seconds, tests)))
    return [item for tests in ordered for item in tests]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Generator[None, None, None]:
    """Order the files once every other plugin has had its say (tiers.py's ``proc`` marks,
    the deselection by ``-m``)."""
    yield
    if hasattr(config, "workerinput"):  # xdist schedules what its workers collected
        items[:] = longest_first(items)
