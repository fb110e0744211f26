"""Run ``train_ddp.py`` as a real two-rank job (forked ranks or ``torchrun``), read what its
ranks print, and act on a chosen line."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .teardown import RankEnd, problems

SCRIPT = Path(__file__).with_name("train_ddp.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
# One math thread per rank: the job shares two cores with everything else.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
#: Longest a job may run before it is killed and reported as hung.
HUNG_AFTER_S = 150.0
#: A line a rank printed: "rank R ...".
_RANK_LINE = re.compile(r"rank \d+ ")


class Job:
    """One launch: the launcher process and every line its ranks printed.

    ``log_dir``: where torchrun keeps each rank's stderr (``--log-dir``); forked ranks have
    theirs printed as ``rank R stderr LINE`` lines instead.
    """

    def __init__(self, argv: list[str], log_dir: Path | None = None) -> None:
        self.argv = argv
        self.log_dir = log_dir
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

    def finish_well(self) -> None:
        """Read to the end and fail unless every rank ended well: exit status 0, or torch's
        gloo teardown crash after it reported everything (see :mod:`.teardown`)."""
        code = self.finish()
        trouble = problems(self.ends()) if code != 0 else []
        if code != 0 and not trouble and not self.ends():
            trouble = [f"the launcher failed with exit status {code}"]
        assert not trouble, "; ".join(trouble) + "\n" + self.describe()

    def ends(self) -> list[RankEnd]:
        """How each rank ended, as its launcher and its own output tell."""
        ranks = sorted({int(line.split()[1]) for line in self.lines if _RANK_LINE.match(line)})
        if self.log_dir is None:
            codes = {
                rank: int(self.of(rank, "exit")[-1]) for rank in ranks if self.of(rank, "exit")
            }
            stopped: set[int] = set()
        else:
            codes, stopped = self._torchrun_report(ranks)
        ends = []
        for rank in ranks:
            prefix = f"rank {rank} "
            said = tuple(
                line[len(prefix) :]
                for line in self.lines
                if line.startswith(prefix) and line.split()[2] not in ("exit", "stderr")
            )
            stderr = "\n".join(self.of(rank, "stderr"))
            if self.log_dir is not None:
                stderr = "\n".join(
                    p.read_text(errors="replace")
                    for p in self.log_dir.glob(f"*/attempt_*/{rank}/stderr.log")
                )
            ends.append(RankEnd(rank, codes.get(rank, 0), said, stderr, rank in stopped))
        return ends

    def _torchrun_report(self, ranks: list[int]) -> tuple[dict[int, int], set[int]]:
        """Exit status of each rank that failed, from torchrun's failure report (a rank it
        does not list exited 0), and the ranks torchrun itself sent SIGTERM to."""
        text = "\n".join(self.lines)
        codes = {
            int(rank): int(code)
            for rank, code in re.findall(
                r"rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+) ", text
            )
        }
        terminated = {
            int(pid) for pid in re.findall(r"Sending process (\d+) closing signal SIGTERM", text)
        }
        stopped = {rank for rank in ranks if self.of(rank, "pid") and self.pid(rank) in terminated}
        return codes, stopped

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
        text = " ".join(self.argv) + "\n" + "\n".join(self.lines[-60:])
        if self.log_dir is not None:  # torchrun kept the ranks' stderr in files
            for path in sorted(self.log_dir.glob("*/attempt_*/*/stderr.log")):
                tail = path.read_text(errors="replace").splitlines()[-20:]
                text += f"\n--- {path.relative_to(self.log_dir)}\n" + "\n".join(tail)
        return text


def forked(directory: Path, total: int, *args: str) -> Job:
    """Two ranks forked by the script itself (one torch import for both)."""
    command = [sys.executable, str(SCRIPT), str(directory), str(total), "--ranks", "2", *args]
    return Job(command)


def torchrun(directory: Path, total: int, *args: str) -> Job:
    """Two ranks started by ``torchrun``, which ends the job when one of them fails. Each
    rank's stderr is kept in a file of its own (``--redirects 2``) to tell which rank wrote
    what."""
    log_dir = Path(tempfile.mkdtemp(prefix="torchrun-logs-", dir=directory.parent))
    command = [
        str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
        "--log-dir", str(log_dir), "--redirects", "2",
        str(SCRIPT), str(directory), str(total), *args,
    ]  # fmt: skip
    return Job(command, log_dir)
