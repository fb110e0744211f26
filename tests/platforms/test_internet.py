"""The internet check: on, off, expected or not, and never slower than its budget.

"The internet" is a server on loopback (on), a closed loopback port (off), or a loopback port
whose connections hang; no test here reaches the real network.
"""

from __future__ import annotations

import re

import pytest
from tests.platforms.conftest import LoopbackServer

import nbresume
from nbresume.platforms.network import InternetProbe


def test_on_is_reported_and_meets_an_expectation(internet_on: LoopbackServer) -> None:
    report = nbresume.preflight(internet=True)
    check = report["internet"]
    assert check.status == "ok"
    assert check.seen.startswith("on")
    assert internet_on.was_reached()


def test_off_fails_an_expectation_with_the_fix() -> None:
    report = nbresume.preflight(internet=True)
    check = report["internet"]
    assert check.status == "fail"
    assert check.seen.startswith("off")
    assert "refused" in check.seen.lower()
    assert "HTTPS_PROXY" in check.fix  # the fix of a machine that is not a notebook service


def test_off_without_an_expectation_is_only_reported() -> None:
    check = nbresume.preflight()["internet"]
    assert check.status == "ok"
    assert check.seen.startswith("off")


def test_on_when_off_was_expected_is_a_warning(internet_on: LoopbackServer) -> None:
    check = nbresume.preflight(internet=False)["internet"]
    assert check.status == "warn"
    assert "Settings → Internet → off" in check.fix


def test_a_name_that_does_not_resolve_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # A malformed name fails in the resolver library itself, without a DNS query.
    monkeypatch.setenv("NBRESUME_PROBE_HOST", "bad..name")
    check = nbresume.preflight(internet=True)["internet"]
    assert check.status == "fail"
    assert "cannot resolve bad..name" in check.seen


@pytest.mark.timeout(30)
def test_a_hanging_connection_does_not_hold_the_preflight(internet_hangs: int) -> None:
    # The connection would hang for minutes: the test's timeout fails it if the report waits
    # for that. (How long the preflight takes is measured in benchmarks/bench_preflight.py.)
    check = nbresume.preflight(internet=True)["internet"]
    assert check.status == "fail"
    # Either the probe's own wait ran out or the connection attempt's 1 s timeout did.
    assert re.search(r"no answer from .* within 1 s|cannot connect to .*: timed out", check.seen)


def test_a_hung_probe_answers_no_answer_when_its_wait_is_over(internet_hangs: int) -> None:
    probe = InternetProbe("127.0.0.1", internet_hangs, timeout=30.0)
    result = probe.result(wait=0.2)
    assert result.online is None
    assert "no answer" in result.seen
