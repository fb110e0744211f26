"""How a run is spread over the workers (tests/schedule.py): file by file, the files expected
to take longest first."""

from __future__ import annotations

import pytest

from schedule import longest_first

pytest_plugins = ["pytester"]

SHARED = """
import pytest

@pytest.fixture(scope="module")
def reference():
    return [1, 2, 3]

def test_first(reference):
    assert reference

def test_second(reference):
    assert reference

def test_alone():
    pass
"""

MIXED = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_long():
    pass
"""

CHILD = """
import subprocess

def test_starts_a_child():
    subprocess.run(["true"], check=True)
"""


def test_the_files_expected_to_take_longest_come_first_each_whole(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_shared=SHARED, test_mixed=MIXED, test_child=CHILD)
    items, _ = pytester.inline_genitems("-p", "tiers")
    assert [item.nodeid for item in longest_first(items)] == [
        "test_mixed.py::test_quick",  # the file of a slow test, in its own order
        "test_mixed.py::test_long",
        "test_child.py::test_starts_a_child",  # a test that starts a process
        "test_shared.py::test_first",  # three tests in this process
        "test_shared.py::test_second",
        "test_shared.py::test_alone",
    ]
