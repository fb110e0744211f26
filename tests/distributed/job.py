"""Run ``train_ddp.py`` as a real two-rank job (forked ranks or ``torchrun``), read what its
ranks print, and act on a chosen line."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_ddp.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
# One math thread per rank: the job shares two cores with everything else.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
#: Longest a job may run before it is killed and reported as hung.
HUNG_AFTER_S = 150.0


class Job:
    """One launch: the launcher process and every line its ranks printed."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=ENV,
            start_new_session=True,  # a hung job is killed with all of its ranks
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._started = time.monotonic()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def _take(self, timeout: float) -> str | None:
        line = self._new.get(timeout=timeout)
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, line: str) -> None:
        """Read until a line equal to ``line``; fail if the job ends or hangs first."""
        while True:
            left = HUNG_AFTER_S - (time.monotonic() - self._started)
            try:
                got = self._take(max(left, 0.01))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"hung before {line!r}\n{self.describe()}") from None
            if got == line:
                return
            if got is None:
                self._new.put(None)
                raise AssertionError(f"ended before {line!r}\n{self.describe()}")

    def finish(self) -> int:
        """Read to the end; the launcher's exit status (a hang kills the job and fails)."""
        while True:
            left = HUNG_AFTER_S - (time.monotonic() - self._started)
            try:
                if self._take(max(left, 0.01)) is None:
                    break
            except queue.Empty:
                self.kill()
                raise AssertionError(f"hung\n{self.describe()}") from None
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def of(self, rank: int, word: str) -> list[str]:
        """The rest of each line of ``rank`` that starts with ``word``."""
        prefix = f"rank {rank} {word} "
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix)]

    def pid(self, rank: int, generation: int = 0) -> int:
        return int(self.of(rank, "pid")[generation])

    def describe(self) -> str:
        return " ".join(self.argv) + "\n" + "\n".join(self.lines[-60:])


def forked(directory: Path, total: int, *args: str) -> Job:
    """Two ranks forked by the script itself (one torch import for both)."""
    command = [sys.executable, str(SCRIPT), str(directory), str(total), "--ranks", "2", *args]
    return Job(command)


def torchrun(directory: Path, total: int, *args: str) -> Job:
    """Two ranks started by ``torchrun``, which ends the job when one of them fails."""
    command = [
        str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
        str(SCRIPT), str(directory), str(total), *args,
    ]  # fmt: skip
    return Job(command)
