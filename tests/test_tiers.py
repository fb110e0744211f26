"""The suite's tiers (tests/tiers.py): a test that starts a process is marked ``proc`` at
collection, and one that the reading misses is caught when it runs, so that the in-process
tier (``-m "not proc"``) stays in-process."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import subprocess

import pytest


def helper():
    return subprocess.run(["true"], check=True)


def test_calls_a_helper_that_starts_a_process():
    helper()


def test_in_process():
    assert sum(range(4)) == 6


def test_hides_its_process():
    # Neither "subprocess" nor a helper of the suite is named here: only the run sees it.
    getattr(__import__("sub" + "process"), "run")(["true"], check=True)


@pytest.mark.proc
def test_says_it_starts_one():
    getattr(__import__("sub" + "process"), "run")(["true"], check=True)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_example=TESTS)
    return pytester


def test_a_test_that_reaches_a_process_is_marked_proc(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-p", "tiers", "-m", "not proc", "--co", "-q")
    collected = result.stdout.str()
    assert "test_in_process" in collected
    assert "test_hides_its_process" in collected  # the reading cannot see it...
    assert "test_calls_a_helper_that_starts_a_process" not in collected
    assert "test_says_it_starts_one" not in collected


@pytest.mark.proc  # the example tests start processes (``true``), inside this test
def test_a_process_the_reading_missed_fails_its_test_at_run_time(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-p", "tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)  # ...but the run does
    result.stdout.fnmatch_lines(["*test_hides_its_process started a process*not marked proc*"])
