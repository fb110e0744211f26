"""No lock of nbresume is held in a forked child.

A process forks while nbresume's threads run: DataLoader workers start at every epoch while
the lease heartbeat runs and a save may be in flight. ``fork()`` keeps only the forking
thread, so a lock another thread held at that moment would stay held in the child forever,
and the child's first nbresume call that takes it would never return.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbresume.checkpoint.store import CheckpointStore
from testkit.paths import TESTS

SCRIPT = TESTS / "fork_while_locked.py"
SOURCE = TESTS.parent / "src" / "nbresume"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform cannot fork")
def test_a_child_forked_while_nbresume_holds_its_locks_runs_nbresume_and_ends(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    parent, child = tmp_path / "parent", tmp_path / "child"
    # The script kills a child that hangs after a minute; the timeout is for the parent.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(parent), str(child)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    said = [line for line in done.stdout.splitlines() if not line.startswith("[")]
    report = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, report
    assert said == [
        # The child holds none of its parent's leases: its save into the parent's folder is
        # refused while the parent runs, and its exit leaves the parent's lease in place.
        "child refused",
        "child saved 3",
        "child ended 0",
        "parent lease kept",
        "parent saved 0",
    ], report
    assert CheckpointStore(child, keep=None).verify().ok


def test_every_lock_of_nbresume_is_made_free_in_a_forked_child() -> None:
    """Locks, reentrant locks and conditions all come from ``forksafe``, which makes them
    new in a forked child."""
    made_here = re.compile(
        r"threading\.(Lock|RLock|Condition)\(|from threading import .*\b(Lock|RLock|Condition)\b"
    )
    found = [
        f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        if path.name != "forksafe.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if made_here.search(line)
    ]
    assert not found, "make these with nbresume.checkpoint.forksafe:\n" + "\n".join(found)
