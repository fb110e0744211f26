"""Training runs forked from one warm process, so that a test can SIGKILL real training
processes without paying torch's import for each of them.

Both sides of it live here:

- in a training script (``train_loop_shapes.py``, ``train_iterable.py``, ...), :func:`serve`
  reads one JSON command a line from stdin, forks a child for it, and prints ``pid P`` when
  the child starts and ``exit P STATUS`` when it ends (``-9`` for a SIGKILL); the child runs
  :func:`run_logged`, which trains with its output appended to the command's log and saves
  the final tensors to the command's ``out``;
- in a test, :class:`Zygote` starts such a script, sends it commands, and kills a run once its
  log shows a condition.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


def say(line: str) -> None:
    """One whole line per write: the background save thread and loader workers write too."""
    os.write(1, (line + "\n").encode())


def run_logged(command: Mapping[str, Any], train: Callable[[Mapping[str, Any]], Tensors]) -> int:
    """Run ``train(command)`` in this process, its output appended to ``command["log"]``, its
    result saved to ``command["out"]``; the exit status (an error is written to the log as
    one ``error ...`` line, read by the test)."""
    log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        torch.save(train(command), command["out"])
    except BaseException as exc:
        say("error " + "".join(traceback.format_exception(exc)).replace("\n", " | "))
        return 1
    return 0


def serve(child: Callable[[dict[str, Any]], int], *, warm_torch: bool = True) -> None:
    """The zygote: fork ``child(command)`` for each command read from stdin, one at a time.
    With ``warm_torch``, what every run would import on its own (an optimizer imports
    torch._dynamo) is imported here first, without starting a thread; a zygote that must not
    start CUDA (a child forked after that could not use it) passes ``False``."""
    if warm_torch:
        torch.set_num_threads(1)
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for line in sys.stdin:
        command = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(child(command))
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {pid} {code}", flush=True)


def steps(text: str) -> list[int]:
    """The steps a run reported (``step N`` lines), in order."""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]


def reached(step: int) -> Callable[[str], bool]:
    """A kill condition: the run reported ``step`` or a later one."""
    return lambda text: bool(steps(text)) and steps(text)[-1] >= step


#: One math thread per process: two cores are shared by the test and its children.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class Zygote:
    """``script serve`` as a test's server of training runs (see the module's docstring).
    Runs write their logs and results in ``workdir``, which is also their ``TMPDIR``: what a
    killed run's DataLoader workers leave (multiprocessing's folders) stays there."""

    def __init__(self, workdir: Path, script: Path) -> None:
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**CHILD_ENV, "TMPDIR": str(workdir)},
        )
        self.runs = 0

    def run(
        self,
        command: Mapping[str, Any],
        *,
        kill_when: Callable[[str], bool] | None = None,
        pause: float = 0.0,
    ) -> tuple[int, str]:
        """Run ``command`` (the training script's own keys; ``log``, ``out`` and ``pause``
        are added). With ``kill_when``, SIGKILL the run once its log satisfies it (or it has
        ended by itself), and pause ``pause`` seconds a step so that the kill lands inside
        the run. Returns (exit status, what the run printed)."""
        pid, log = self.start(command, pause=pause if kill_when else 0.0)
        try:
            if kill_when is not None:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    text = log.read_text() if log.exists() else ""
                    if kill_when(text) or "done " in text or "error " in text:
                        os.kill(pid, signal.SIGKILL)
                        break
                    time.sleep(0.001)
            status = self.wait(pid)
        finally:
            self.ended(pid)
        return status, log.read_text()

    def start(self, command: Mapping[str, Any], *, pause: float) -> tuple[int, Path]:
        """Send ``command``; the run's pid and its log."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.runs += 1
        log = self.workdir / f"run-{self.runs}.log"
        out = self.workdir / f"final-{self.runs}.pt"
        full = {**command, "log": str(log), "out": str(out), "pause": pause}
        self.proc.stdin.write(json.dumps(full) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1]), log

    def wait(self, pid: int) -> int:
        """The exit status of run ``pid`` (``-9`` where it was killed)."""
        assert self.proc.stdout is not None
        _, reported_pid, status = self.proc.stdout.readline().split()
        assert int(reported_pid) == pid
        return int(status)

    def ended(self, pid: int) -> None:
        """Called once run ``pid`` has ended or failed: what a subclass cleans up after it."""

    def final(self) -> Tensors:
        """The final tensors of the last run."""
        tensors: Tensors = torch.load(self.workdir / f"final-{self.runs}.pt", weights_only=True)
        return tensors

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
