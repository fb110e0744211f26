"""Kill a checkpointing process at chosen instants and check what it leaves behind.

The writer is ``saver.py`` in a child process; this side only reads the folder (it never
writes), as a fresh process resuming the run would. After each kill it checks the promise:
every checkpoint that is visible verifies, the newest one loads and holds exactly the state
of its step, no checkpoint reported as saved was lost, and retention never left fewer
verified checkpoints than it keeps. The next writer then resumes from that folder, so the
leftovers of every kill meet the code that must clean them up.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nbresume.checkpoint.backends import DELETING_PREFIX, REPLACED_PREFIX
from nbresume.checkpoint.format import MANIFEST_NAME, TEMP_PREFIX, parse_step_dirname
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import NoCheckpointError
from testkit import warmfork

from .saver import state_mismatch

SAVER = Path(__file__).with_name("saver.py")
# One BLAS thread: NumPy starts in half the time, and the kills are all about start-up.
CHILD_ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
KILLED = -signal.SIGKILL


@dataclass
class Run:
    """What one child process said before it died or ended."""

    pid: int
    returncode: int
    resumed: int
    skipped: int
    started: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    stderr: str = ""

    def parse(self, line: str, starts: dict[int, float]) -> tuple[str, list[str]]:
        if not line.strip():
            return "", []
        kind, *rest = line.split()
        if kind == "resumed":
            self.resumed, self.skipped = int(rest[0]), int(rest[1])
        elif kind == "start":
            self.started.append(int(rest[0]))
            starts[int(rest[0])] = float(rest[1])
        elif kind == "saved":
            step = int(rest[0])
            self.saved.append(step)
            self.durations.append(float(rest[1]) - starts[step])
        elif kind == "event":
            self.events.append(" ".join(rest))
        elif kind == "warning":
            self.warnings.append(" ".join(rest))
        elif kind == "error":
            self.error = " ".join(rest)
        return kind, rest


def spawn(root: Path, keep: int, *options: str, stderr_to: Path) -> warmfork.WarmProcess:
    """Start the saver, forked from the suite's warm server (no torch import to pay)."""
    with open(stderr_to, "w") as err:
        return warmfork.popen(
            [sys.executable, str(SAVER), str(root), "--keep", str(keep), *options],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=CHILD_ENV,
        )


def finish(proc: warmfork.WarmProcess, run: Run, starts: dict[int, float], err: Path) -> Run:
    """Collect what the child printed after the parent stopped listening, and its status."""
    assert proc.stdout is not None
    rest = proc.stdout.read()
    proc.wait()
    proc.close()
    # A child killed in the middle of a print leaves a partial last line ("saved 1" of
    # "saved 13 ..."): only whole lines count.
    for line in rest.split("\n")[:-1]:
        run.parse(line, starts)
    run.returncode = proc.returncode
    run.stderr = err.read_text()
    return run


def run_to_end(root: Path, keep: int, *options: str, workdir: Path) -> Run:
    """Run the saver to completion (no kill)."""
    err = workdir / "stderr.txt"
    proc = spawn(root, keep, *options, stderr_to=err)
    run = finish(proc, Run(proc.pid, 0, -1, 0), {}, err)
    assert run.returncode == 0, f"the saver failed (status {run.returncode}):\n{run.stderr}"
    return run


def hidden_leftovers(root: Path) -> set[str]:
    return {name for name in os.listdir(root) if name.startswith(".")}


def step_folders(root: Path) -> list[int]:
    return sorted(s for s in map(parse_step_dirname, os.listdir(root)) if s is not None)


def classify(root: Path, run: Run, step: int, keep: int, resave: bool) -> str:
    """Which part of ``save(step)`` the kill interrupted, judged by what is left on disk."""
    if step in run.saved:
        return "after save() returned, before the next one"
    mine = [n for n in hidden_leftovers(root) if f"-{run.pid}-" in n]
    temp = [n for n in mine if n.startswith(TEMP_PREFIX)]
    if any(n.startswith(REPLACED_PREFIX) for n in mine):
        if temp:
            return "commit: between moving the old copy aside and renaming the new one in"
        return "commit: removing the replaced old copy"
    if temp:
        files = os.listdir(root / temp[0])
        if not files:
            return "temporary folder created, nothing written"
        if MANIFEST_NAME not in files:
            return "payload files being written"
        try:
            json.loads((root / temp[0] / MANIFEST_NAME).read_bytes())
        except ValueError:
            return "manifest being written"
        return "manifest written: fsync and rename"
    if any(n.startswith(DELETING_PREFIX) for n in mine):
        return "retention: deleting an old checkpoint"
    if resave:
        return "resave: before the temporary folder, or after the commit"
    if step not in step_folders(root):
        return "before writing (recovery, encoding, space check)"
    if len(step_folders(root)) > keep:
        return "committed: verification read-back, retention listing"
    return "committed and pruned, not yet returned"


def check_folder(root: Path, keep: int, reported: set[int], started: int, context: str) -> int:
    """The checks a fresh reader makes after a kill; returns the step it would resume from."""
    store = CheckpointStore(root, keep=keep)
    report = store.verify()
    bad = [str(r) for r in report.results if not r.ok]
    assert not bad, f"{context}: a visible checkpoint does not verify: {bad}"
    steps = sorted(r.step for r in report.results)
    assert len(steps) >= min(keep, len(reported)), (
        f"{context}: only {steps} verify, fewer than keep={keep} "
        f"although {len(reported)} saves were reported"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped (corrupt) newer checkpoint fails the test
        try:
            loaded = store.load(framework="numpy")
        except NoCheckpointError:
            assert not reported, (
                f"{context}: nothing loads, but steps {sorted(reported)} were saved"
            )
            return 0
    newest_reported = max(reported, default=0)
    assert loaded.step >= newest_reported, (
        f"{context}: load() gives step {loaded.step}, but step {newest_reported} was reported saved"
    )
    assert loaded.step == steps[-1], f"{context}: load() gives {loaded.step}, {steps} verify"
    assert loaded.step <= started, f"{context}: step {loaded.step} was never started"
    for step in steps:
        checkpoint = loaded if step == loaded.step else store.load(step, framework="numpy")
        problem = state_mismatch(step, checkpoint.tensors, checkpoint.data)
        assert not problem, f"{context}: checkpoint of step {step}: {problem}"
    return loaded.step


@dataclass
class Campaign:
    """Kills accumulating over one folder, with what was seen along the way."""

    root: Path
    keep: int
    rng: random.Random
    workdir: Path
    reported: set[int] = field(default_factory=set)
    durations: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=40)
    )
    phases: collections.Counter[str] = field(default_factory=collections.Counter)
    late: int = 0
    overshot: int = 0
    kills: int = 0
    resume_from: int = 0

    def prime(self, saves: int) -> None:
        """Save a few checkpoints without a kill, which also measures how long a save takes."""
        run = run_to_end(self.root, self.keep, "--saves", str(saves), workdir=self.workdir)
        self.reported.update(run.saved)
        self.durations.extend(run.durations)
        self.resume_from = check_folder(
            self.root, self.keep, self.reported, max(run.started), "after priming"
        )

    def window(self) -> float:
        """How long a save takes: kill offsets are drawn uniformly from [0, window] after a save
        starts, so each phase is hit in proportion to its duration. The median, widened by a
        third, covers a typical save (a few land just after it returned) and ignores the rare
        save stalled by the file system."""
        return statistics.median(self.durations) * 4 / 3

    def kill_once(self) -> str:
        resave = self.rng.random() < 0.2
        target = self.rng.randrange(3)  # which save of this run to kill
        options = ["--resave"] if resave else []
        before = hidden_leftovers(self.root)
        err = self.workdir / "stderr.txt"
        proc = spawn(self.root, self.keep, *options, stderr_to=err)
        run = Run(proc.pid, 0, -1, 0)
        starts: dict[int, float] = {}
        killed_in: int | None = None
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            if not line.endswith("\n"):
                break  # the child died mid-print: a partial line says nothing
            kind, rest = run.parse(line, starts)
            if kind == "start" and len(run.started) == target + 1:
                offset = self.rng.uniform(0.0, self.window())
                delay = float(rest[1]) + offset - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    self.late += 1  # read the line too late: killed as soon as possible
                os.kill(proc.pid, signal.SIGKILL)
                killed_in = int(rest[0])
                break
        finish(proc, run, starts, err)
        context = (
            f"kill {self.kills + 1} (aimed at save {killed_in}, resave={resave}, pid {run.pid}, "
            f"reported before {sorted(self.reported)[-4:]}, this run {run.started} {run.saved})"
        )
        assert killed_in is not None, f"{context}: the saver ended before the kill:\n{run.stderr}"
        if killed_in in run.saved:
            self.overshot += 1  # the offset outlasted that save: the kill hit what came next
        assert run.returncode == KILLED, f"{context}: status {run.returncode}:\n{run.stderr}"
        assert run.resumed == self.resume_from, (
            f"{context}: the writer resumed from step {run.resumed}, a reader from "
            f"{self.resume_from}"
        )
        assert run.skipped == 0, f"{context}: the writer passed over a corrupt checkpoint"
        self.kills += 1
        self.reported.update(run.saved)
        self.durations.extend(run.durations)
        last = run.started[-1]
        phase = classify(self.root, run, last, self.keep, resave and last == run.started[0])
        self.phases[phase] += 1
        self.resume_from = check_folder(self.root, self.keep, self.reported, last, context)
        if run.saved:
            stale = before & hidden_leftovers(self.root)
            assert not stale, f"{context}: leftovers of earlier kills survived a save: {stale}"
        return phase

    def summary(self) -> str:
        lines = [
            f"{self.kills} kills, {len(self.reported)} steps reported saved, "
            f"save window {self.window() * 1000:.1f} ms, {self.late} kills late, "
            f"{self.overshot} after the aimed-at save returned"
        ]
        lines += [f"{count:5d}  {phase}" for phase, count in self.phases.most_common()]
        return "\n".join(lines)


def sweep_events(root: Path, keep: int, *, resave: bool, workdir: Path) -> Iterator[str]:
    """Kill the writer just before each file system operation of a save, in turn.

    Operations are counted from the creation of the temporary folder, so that the cleanup of
    the previous kill's leftovers (which happens first) does not shift them. Yields, per kill,
    the operation it died before.
    """
    reported: set[int] = set()
    primed = run_to_end(root, keep, "--saves", str(keep + 1), workdir=workdir)
    reported.update(primed.saved)
    options = ["--saves", "1", "--list-events"] + (["--resave"] if resave else [])
    listing = run_to_end(root, keep, *options, workdir=workdir)
    reported.update(listing.saved)
    resume_from = check_folder(root, keep, reported, max(listing.saved), "after listing")
    for index in range(len(listing.events)):
        before = hidden_leftovers(root)
        err = workdir / "stderr.txt"
        proc = spawn(root, keep, *options, "--die-at-event", str(index), stderr_to=err)
        run = finish(proc, Run(proc.pid, 0, -1, 0), {}, err)
        died_before = run.events[-1] if run.events else "(none)"
        context = f"killed before operation {index} ({died_before}), resave={resave}"
        assert run.resumed == resume_from, (
            f"{context}: the writer resumed from {run.resumed}, a reader from {resume_from}"
        )
        assert run.skipped == 0, f"{context}: the writer passed over a corrupt checkpoint"
        if run.returncode != KILLED:
            # The sequence can be shorter than the listing (retention had less to delete).
            assert run.returncode == 0, f"{context}: status {run.returncode}:\n{run.stderr}"
        reported.update(run.saved)
        stale = before & hidden_leftovers(root)
        assert not stale, f"{context}: leftovers of the previous kill survived: {stale}"
        resume_from = check_folder(root, keep, reported, max(run.started), context)
        yield died_before
        if len(step_folders(root)) > keep:
            # Killed after the commit, before retention: one whole save puts the folder back
            # in the state of the listing, so that the next index is the same operation.
            after = run_to_end(root, keep, "--saves", "1", workdir=workdir)
            reported.update(after.saved)
            assert after.resumed == resume_from, f"{context}: the next writer resumed elsewhere"
            resume_from = check_folder(root, keep, reported, max(after.saved), context + ", next")
