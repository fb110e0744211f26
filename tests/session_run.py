"""Running a training script that a test kills, without waiting on what it leaves behind.

A DataLoader worker forked just before its parent is killed can live on for good: the worker
builds its watchdog from ``os.getppid()`` once it starts (``torch.utils.data._utils.worker.
ManagerWatchdog``), and when the parent died in between, that is already the process that
adopted it, so it never sees its parent die. Such an orphan keeps the parent's stdout and
stderr open: ``subprocess.run(capture_output=True)`` then waits for their end until its
timeout. Seen once in the Lightning kill test (SIGKILL 11 ms into a save at an epoch's end,
as the next epoch forked its workers; the worker was found alive 18 minutes later).

:func:`run_in_session` runs the command (a Python one, forked from the suite's warm server:
``testkit.warmfork``) in a session of its own, its output in files, and once it has ended,
ends the DataLoader workers left in its session. Any other process left there fails the run:
only that upstream race is recognised.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from testkit import warmfork

#: The name torch gives its DataLoader worker processes.
WORKER_NAME = "pt_data_worker"


def run_in_session(
    command: Sequence[str], *, env: dict[str, str], timeout: float, output: Path
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` until it ends (``subprocess.TimeoutExpired`` after ``timeout``
    seconds, the whole session killed); its stdout and stderr go to ``output``.out and
    ``output``.err. Leftover DataLoader workers of its session are killed; any other
    leftover process is killed too and raises ``AssertionError``."""
    out_path, err_path = output.with_suffix(".out"), output.with_suffix(".err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = warmfork.popen(list(command), env=env, stdout=out, stderr=err)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(process.pid)
            process.wait()
            raise
        finally:
            process.close()
    left = _kill_session(process.pid)
    strangers = [f"{pid} ({name})" for pid, name in left if name != WORKER_NAME]
    assert not strangers, f"{command[:2]} left processes behind: {', '.join(strangers)}"
    return subprocess.CompletedProcess(
        list(command), code, out_path.read_text(errors="replace"),
        err_path.read_text(errors="replace"),
    )  # fmt: skip


def _kill_session(session: int) -> list[tuple[int, str]]:
    """SIGKILL every process of ``session``; their pids and names."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue  # it ended meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session:  # state, ppid, pgrp, session
            found.append((int(entry.name), name))
    for pid, _ in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found
