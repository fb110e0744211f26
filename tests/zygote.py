"""Training runs a test can SIGKILL, forked from the suite's warm server (``testkit.warmfork``)
so that none pays torch's import.

Both sides of it live here:

- in a training script (``train_loop_shapes.py``, ``train_iterable.py``, ...), :func:`main`
  runs the JSON command given as the script's argument with :func:`run_logged`, which trains
  with its output appended to the command's log and saves the final tensors to the command's
  ``out``;
- in a test, :class:`Zygote` runs such a script for each command and kills a run once its log
  shows a condition.
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

from testkit import warmfork

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


def main(child: Callable[[dict[str, Any]], int]) -> None:
    """A training script's entry point: ``python SCRIPT COMMAND_JSON`` exits with
    ``child(command)``."""
    sys.exit(child(json.loads(sys.argv[1])))


def steps(text: str) -> list[int]:
    """The steps a run reported (``step N`` lines), in order."""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]


def reached(step: int) -> Callable[[str], bool]:
    """A kill condition: the run reported ``step`` or a later one."""
    return lambda text: bool(steps(text)) and steps(text)[-1] >= step


#: One math thread per process: two cores are shared by the test and its children.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class Zygote:
    """A test's runs of ``script`` (see the module's docstring), each its own process forked
    from the warm server. Runs write their logs and results in ``workdir``, which is also
    their ``TMPDIR``: what a killed run's DataLoader workers leave (multiprocessing's folders)
    stays there."""

    def __init__(self, workdir: Path, script: Path) -> None:
        self.workdir = workdir
        self.script = script
        self.running: dict[int, warmfork.WarmProcess] = {}
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
        """Start a run of ``command``; its pid and its log."""
        self.runs += 1
        log = self.workdir / f"run-{self.runs}.log"
        out = self.workdir / f"final-{self.runs}.pt"
        full = {**command, "log": str(log), "out": str(out), "pause": pause}
        proc = warmfork.popen(
            [sys.executable, str(self.script), json.dumps(full)],
            stdin=subprocess.DEVNULL,
            env={**CHILD_ENV, "TMPDIR": str(self.workdir)},
        )
        self.running[proc.pid] = proc
        return proc.pid, log

    def wait(self, pid: int) -> int:
        """The exit status of run ``pid`` (``-9`` where it was killed)."""
        proc = self.running.pop(pid)
        try:
            return proc.wait()
        finally:
            proc.close()

    def ended(self, pid: int) -> None:
        """Called once run ``pid`` has ended or failed: what a subclass cleans up after it."""

    def final(self) -> Tensors:
        """The final tensors of the last run."""
        tensors: Tensors = torch.load(self.workdir / f"final-{self.runs}.pt", weights_only=True)
        return tensors

    def close(self) -> None:
        """End the runs still going (a test that failed in the middle of one)."""
        for proc in self.running.values():
            proc.kill()
            proc.close()
        self.running.clear()
