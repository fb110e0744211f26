"""A job as ``nbresume run`` records it, without running ``nbresume run``."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from nbresume.checkpoint.procfs import boot_id
from nbresume.runner import RunState, process_start, state_path


class RecordedJob:
    """A live process (a ``sleep``) recorded in the run state of a job that saves into
    ``ckpt``, running since ``started`` (a Unix time); killed when the ``with`` block ends."""

    def __init__(self, ckpt: Path, cwd: Path, started: float) -> None:
        self.ckpt, self.cwd, self.started = ckpt, cwd, started

    def __enter__(self) -> subprocess.Popen[bytes]:
        self.job = subprocess.Popen(["sleep", "120"])
        try:
            state = RunState(
                command=["python", "train.py"],
                log=str(self.ckpt / "nbresume-run.log"),
                cwd=str(self.cwd),
                dir=str(self.ckpt),
                boot_id=boot_id(),
                started=self.started,
                status="running",
                supervisor_pid=self.job.pid,
                supervisor_start=process_start(self.job.pid),
                pid=self.job.pid,
                pid_start=process_start(self.job.pid),
                pgid=self.job.pid,
                attempt=1,
                attempt_started=self.started,
            )
            state.write(state_path(Path(state.log)))
        except BaseException:
            self.__exit__()
            raise
        return self.job

    def __exit__(self, *exc: Any) -> None:
        self.job.kill()
        self.job.wait()
