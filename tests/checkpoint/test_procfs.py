"""The one answer to "does this process still run": a pid reused by a later process, a pid
no process can have, and a missing pid are not the process asked about."""

from __future__ import annotations

import os

import pytest

from nbresume.checkpoint import procfs


def test_this_process_runs_and_is_told_apart_from_a_later_one_under_its_pid() -> None:
    assert procfs.process_runs(os.getpid())
    started = procfs.start_ticks(os.getpid())
    if started is None:
        pytest.skip("no /proc here: a reused pid cannot be told apart")
    assert procfs.process_runs(os.getpid(), started)
    assert procfs.process_runs(os.getpid(), str(started))  # as a lease file records it
    assert not procfs.process_runs(os.getpid(), started + 1)


@pytest.mark.parametrize("pid", [None, 0, -1, 2**40])
def test_no_pid_or_an_impossible_one_does_not_run(pid: int | None) -> None:
    assert not procfs.process_runs(pid)
