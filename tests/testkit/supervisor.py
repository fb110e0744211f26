"""A job as ``nbresume run`` records it, without running ``nbresume run``."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from nbresume.checkpoint.procfs import boot_id
from nbresume.runner import RunState, process_start, state_path


@contextlib.contextmanager
def a_recorded_job(ckpt: Path, cwd: Path, started: float) -> Iterator[subprocess.Popen[bytes]]:
    """A live process (a ``sleep``) recorded in the run state of a job that saves into
    ``ckpt``, running since ``started`` (a Unix time); the process is killed afterwards."""
    job = subprocess.Popen(["sleep", "120"])
    try:
        state = RunState(
            command=["python", "train.py"],
            log=str(ckpt / "nbresume-run.log"),
            cwd=str(cwd),
            dir=str(ckpt),
            boot_id=boot_id(),
            started=started,
            status="running",
            supervisor_pid=job.pid,
            supervisor_start=process_start(job.pid),
            pid=job.pid,
            pid_start=process_start(job.pid),
            pgid=job.pid,
            attempt=1,
            attempt_started=started,
        )
        state.write(state_path(Path(state.log)))
        yield job
    finally:
        job.kill()
        job.wait()
