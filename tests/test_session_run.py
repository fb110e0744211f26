"""The helper that runs killed training scripts (tests/session_run.py) ends the DataLoader
workers a killed run leaves behind and nothing else: a leftover of another kind fails."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from tests.session_run import run_in_session

#: The parent forks a child that names itself NAME, says its pid and sleeps; the parent waits
#: for that line, then exits.
ORPHAN = """
import ctypes, os, sys, time
read, write = os.pipe()
if os.fork() == 0:
    ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
    print(f"child {os.getpid()}", flush=True)
    os.write(write, b"x")
    time.sleep(600)
    os._exit(0)
os.read(read, 1)
print("parent done", flush=True)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def orphan_pid(stdout: str) -> int:
    return int(next(line for line in stdout.splitlines() if line.startswith("child ")).split()[1])


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie waiting for its reaper counts as ended)."""
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_dataloader_worker_left_behind_is_ended_and_the_run_returns(tmp_path: Path) -> None:
    # The orphan sleeps 600 s: a run that waited on it would time out after 60.
    done = run_in_session([sys.executable, "-c", ORPHAN, "pt_data_worker"], env=dict(os.environ),
                          timeout=60, output=tmp_path / "run")  # fmt: skip
    assert done.returncode == 0
    assert "parent done" in done.stdout
    assert gone(orphan_pid(done.stdout))


def test_any_other_process_left_behind_fails_the_run(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="left processes behind") as failed:
        run_in_session([sys.executable, "-c", ORPHAN, "stray-helper"], env=dict(os.environ),
                       timeout=60, output=tmp_path / "run")  # fmt: skip
    assert "stray-helper" in str(failed.value)
    assert gone(orphan_pid((tmp_path / "run.out").read_text()))  # killed all the same
