"""The training log of ``nbresume run`` outlives the machine: it is copied into the checkpoint
folder when written elsewhere, and ``nbresume pull`` brings it back with the checkpoints."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit.cli import run_command

JOB = """
import sys
import torch
from nbresume import Checkpointer

print("hello from the job", flush=True)
ckpt = Checkpointer(sys.argv[1], every=None, deadline=None, quiet=True,
                    model=torch.nn.Linear(2, 2))
for _ in ckpt.steps(2):
    pass
print("the job is done", flush=True)
"""


def _nbresume(*args: str) -> subprocess.CompletedProcess[str]:
    return run_command(*args, timeout=300)


@pytest.mark.slow
def test_the_log_is_copied_next_to_the_checkpoints_and_pulled_back(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    scratch_log = tmp_path / "scratch" / "train.log"  # the machine's own disk
    durable = tmp_path / "durable"
    done = _nbresume(
        "run", "--log", str(scratch_log), "--dir", str(durable), "--",
        sys.executable, str(job), str(durable),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    copy = (durable / "nbresume-run.log").read_text()
    assert "hello from the job" in copy
    assert "the job is done" in copy
    assert copy == scratch_log.read_text()  # the copy was made after the last line

    scratch_log.unlink()  # the machine is torn down
    pulled = tmp_path / "pulled"
    done = _nbresume("pull", str(durable), str(pulled))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nbresume-run.log" in done.stdout
    assert "the job is done" in (pulled / "nbresume-run.log").read_text()
