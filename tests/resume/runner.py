"""Drive ``train_cnn.py`` in a child process: read what it prints, act at a chosen line.

The child is forked from the suite's warm server (``testkit.warmfork``: a fresh interpreter
without torch's import to pay for each run). It runs in its own process group, so that a
SIGKILL can take it down with its DataLoader workers at once, as a preempted machine or an
OOM-killed container does; other signals go to the main process only, as a notebook's
interrupt button, ``kill PID``, ``docker stop`` or Kubernetes send them, unless ``to_group`` is
set (Slurm's ``scancel`` signals every process of the job step).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from nbresume.checkpoint.store import CheckpointStore
from testkit import warmfork

TRAIN = Path(__file__).with_name("train_cnn.py")
# One math thread per process: two cores are shared by the trainer and its two workers.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
STEPS_PER_EPOCH = 12  # 96 samples, batches of 8
#: Longest a single run may take before it is killed and reported as hung.
HUNG_AFTER_S = 180.0


@dataclass
class Run:
    """What one run of the training script printed, and how it ended."""

    argv: list[str]
    lines: list[str] = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""
    signalled: str = ""  # the signal the test sent, and after which line
    hung: bool = False
    #: Processes of the run (DataLoader workers) still alive after its main process ended.
    leftovers: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        """The step the run continued from (its "start N" line)."""
        for line in self.lines:
            if line.startswith("start "):
                return int(line.split()[1])
        raise AssertionError(f"no 'start' line\n{self.describe()}")

    @property
    def steps(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("step ")]

    @property
    def events(self) -> list[tuple[str, int]]:
        out = []
        for line in self.lines:
            if line.startswith("event "):
                _, kind, step = line.split()
                out.append((kind, int(step)))
        return out

    def saw(self, kind: str, step: int) -> bool:
        return (kind, step) in self.events

    @property
    def done(self) -> tuple[bool, int] | None:
        """(done, step) from the "done <bool> step N" line, if the run got that far."""
        for line in self.lines:
            if line.startswith("done "):
                _, flag, _, step = line.split()
                return flag == "True", int(step)
        return None

    @property
    def final(self) -> str | None:
        for line in self.lines:
            if line.startswith("final "):
                return line.split()[1]
        return None

    def describe(self) -> str:
        """Everything a failure message needs to replay and understand this run."""
        shown = self.lines if len(self.lines) <= 80 else ["...", *self.lines[-80:]]
        return (
            f"command: {' '.join(self.argv)}\n"
            f"status: {self.returncode}{' (hung, killed)' if self.hung else ''}"
            f"{'; sent ' + self.signalled if self.signalled else ''}\n"
            f"stdout:\n  " + "\n  ".join(shown) + f"\nstderr:\n{self.stderr[-4000:]}"
        )


#: Decides, after each line, whether to send the signal now.
Trigger = Callable[[Run], bool]


def train(
    folder: Path,
    total: int,
    *options: str,
    trigger: Trigger | None = None,
    signum: int = signal.SIGKILL,
    delay: float = 0.0,
    to_group: bool | None = None,
    repeat: float | None = None,
    env: dict[str, str] | None = None,
    warm: bool = True,
) -> Run:
    """Run ``train_cnn.py folder total *options`` to its end. When ``trigger`` first returns
    True, wait ``delay`` seconds and send ``signum`` (SIGKILL goes to the whole process group
    unless ``to_group`` says otherwise; other signals to the main process only); with
    ``repeat``, send it a second time that many seconds later. ``env``: more variables for
    the child; ``warm=False``: a new interpreter rather than a child of the warm server."""
    argv = [sys.executable, str(TRAIN), str(folder), str(total), "--trace", *options]
    run = Run(argv)
    group = signum == signal.SIGKILL if to_group is None else to_group
    err_path = folder.parent / f"stderr-{folder.name}.txt"
    with open(err_path, "w") as err:
        launch = warmfork.popen if warm else partial(subprocess.Popen, start_new_session=True)
        proc = launch(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            # Its DataLoader workers, killed with it, leave multiprocessing's temporary
            # folders behind: beside the run's folder, not in /tmp.
            env={**CHILD_ENV, "TMPDIR": str(folder.parent), **(env or {})},
        )

    def kill_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def hung() -> None:
        run.hung = True
        # The trainer dumps every thread's stack on SIGUSR2 (into stderr, which the report
        # shows): where a hung run waits is then known, not guessed.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR2)
        time.sleep(2.0)
        kill_group(signal.SIGKILL)

    watchdog = threading.Timer(HUNG_AFTER_S, hung)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if not raw.endswith("\n"):
                break  # killed mid-print: a partial line ("step 1" of "step 12") says nothing
            run.lines.append(raw.rstrip("\n"))
            if trigger is not None and not run.signalled and trigger(run):
                if delay:
                    time.sleep(delay)
                run.signalled = f"{signal.Signals(signum).name} after {run.lines[-1]!r}"
                for pause in [0.0] if repeat is None else [0.0, repeat]:
                    time.sleep(pause)
                    if group:
                        kill_group(signum)
                    else:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(proc.pid, signum)
        proc.wait()
        run.leftovers = group_members(proc.pid)
    finally:
        watchdog.cancel()
        kill_group(signal.SIGKILL)  # DataLoader workers left behind by a killed trainer
        proc.wait()
        if isinstance(proc, subprocess.Popen):
            assert proc.stdout is not None
            proc.stdout.close()
        else:
            proc.close()
    run.returncode = proc.returncode
    run.stderr = err_path.read_text()
    assert not run.hung, f"the training run hung\n{run.describe()}"
    return run


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux /proc; empty elsewhere)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.parent.name))
    return members


def checkpoints(folder: Path) -> dict[int, bool]:
    """Every committed checkpoint in ``folder`` and whether it verifies, read the way a
    restarted run reads them (this process never writes there)."""
    report = CheckpointStore(folder, keep=None).verify()
    return {result.step: result.ok for result in report.results}


def after_line(text: str) -> Trigger:
    """Fire on the first line equal to ``text``."""
    return lambda run: run.lines[-1] == text


def finished_cleanly(run: Run, total_steps: int) -> str:
    """Why ``run`` did not end as a completed training run does ("" when it did)."""
    if run.returncode != 0:
        return f"status {run.returncode}"
    if run.done != (True, total_steps):
        return f"ended with {run.done}, expected done True at step {total_steps}"
    if any(kind == "failed" for kind, _ in run.events):
        return "a save failed"
    if "Traceback" in run.stderr:
        return "a traceback on stderr"
    if run.leftovers:
        return f"processes {run.leftovers} outlived the run"
    return ""
