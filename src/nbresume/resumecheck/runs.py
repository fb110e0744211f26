"""The two runs of ``nbresume check``: one uninterrupted, one killed and started again.

Each run is the user's own command, in a process group of its own, with the environment
knobs that make it a comparable run: ``NBRESUME_CHECK_DIR`` (every Checkpointer saves into a
folder of the run's own), ``NBRESUME_STOP_AT_STEP`` where the check has a budget (every loop
saves and stops at the same step N, a resumed run included) and ``NBRESUME_SAVE_EVERY=1`` (a
save after every step, so that a kill lands between saves or inside one).

Each run has a working folder of its own (:func:`working_folder`): it shows every entry of the
current folder through a link, so that the script finds its files and data as it names them,
while what it creates under a relative path that does not exist yet (Accelerate's
``project_dir``, a Trainer's ``output_dir``, Lightning's ``default_root_dir``) is the run's
own: two runs side by side do not write into one folder.

A kill is aimed from outside, by watching the checkpoint folders: a save in progress is a
hidden ``.nbresume-tmp-<step>-...`` folder that the commit renames into place. When the
moment comes, the whole process group is stopped (SIGSTOP) first, the folders are looked at
again while nothing moves, and only then is it killed (SIGKILL), or let go on (SIGCONT) when
the moment has passed: a kill reported as "inside a save" was one, and no kill ever lands
after the final save of step N began (a resumed run would then train past N).

However a run ends (the script's own exit, a planned kill, a timeout, Ctrl-C or SIGTERM sent to
``nbresume check``), its whole process group is ended with it (:func:`end_groups`): what the
script started and left running (DataLoader workers, a shell's children, a process in the
background) is sent SIGTERM, and SIGKILL after :data:`GRACE_S`. The script's first process is
reaped only after that: until then its pid, which is the group's id, cannot be taken by another
process, so no signal meant for the group reaches anything else.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nbresume import knobs
from nbresume.checkpoint import procfs
from nbresume.checkpoint.format import TEMP_PREFIX, parse_step_dirname
from nbresume.errors import NbresumeError

#: Seconds between two looks at the checkpoint folders while a kill is aimed.
POLL_S = 0.001
#: Seconds to wait for a stopped process group to be stopped for sure.
STOP_WAIT_S = 1.0
#: Seconds the script's processes are given to end after SIGTERM before they are killed.
GRACE_S = 5.0
#: The most bytes of a log read for its last lines, and the most characters shown of a line.
TAIL_BYTES = 64 << 10
LINE_CHARS = 400


class RunFailed(NbresumeError):
    """The script failed, or ran past the time it was given, in one of the runs."""


@dataclass(frozen=True)
class Progress:
    """What the checkpoint folders of a run show at one moment."""

    #: The newest committed step (``None``: no checkpoint yet).
    committed: int | None
    #: Saves in progress: their hidden folder (as ``subfolder/name``) and step.
    pending: dict[str, int]

    def newest(self, ignore: Collection[str] = ()) -> int:
        """The newest step committed or being saved (0 when none), ``ignore`` aside."""
        steps = [s for n, s in self.pending.items() if n not in ignore]
        return max([self.committed or 0, *steps])


def look(root: Path) -> Progress:
    """The newest committed step and the saves in progress under ``root`` (every
    Checkpointer's folder is a sub-folder of it)."""
    committed: int | None = None
    pending: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for folder in os.scandir(root):
            if not folder.is_dir():
                continue
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for entry in os.scandir(folder.path):
                    step = parse_step_dirname(entry.name)
                    if step is not None:
                        committed = step if committed is None else max(committed, step)
                    elif entry.name.startswith(TEMP_PREFIX):
                        digits = entry.name[len(TEMP_PREFIX) :].split("-", 1)[0]
                        pending_step = parse_step_dirname(digits)
                        if pending_step is not None:
                            pending[f"{folder.name}/{entry.name}"] = pending_step
    return Progress(committed, pending)


@dataclass
class Kill:
    """One planned kill: at the first save of ``target`` or later (``in_save``), or once
    ``target`` is committed, between saves where one is found."""

    target: int
    in_save: bool


@dataclass
class Leg:
    """One process of a run: where it started, and how it ended."""

    resumed_at: int | None
    #: "done", or how it was killed.
    ended: str
    #: The step it was killed at (the save in progress, else the newest committed step).
    step: int | None = None
    inside_save: bool = False
    seconds: float = 0.0


@dataclass
class Run:
    """A run of the script: its folders, its log and its processes."""

    name: str
    root: Path
    log: Path
    legs: list[Leg] = field(default_factory=list)
    #: The run's working folder (:func:`working_folder`); ``None``: the current folder.
    cwd: Path | None = None


def working_folder(folder: Path, source: Path) -> Path:
    """Make ``folder`` a working folder that shows every entry of ``source`` (the current
    folder) through a symbolic link, and return it. What the script reads, it finds where it
    names it; what it creates under a relative path that ``source`` lacks stays in
    ``folder``. A folder that exists in ``source`` is shared (its link leads there)."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        for entry in os.scandir(source):
            with contextlib.suppress(OSError):
                (folder / entry.name).symlink_to(Path(source, entry.name))
    return folder


def environment(root: Path, steps: int | None, cwd: Path | None = None) -> dict[str, str]:
    """The script's environment: this one, with the knobs of a check run (``steps``: the
    budget every loop stops at; ``None``: none, the script runs to its end)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (knobs.SMOKE_STEPS.name, knobs.STOP_AT_STEP.name)
    }
    env.update(
        {knobs.CHECK_DIR.name: str(root), knobs.SAVE_EVERY.name: "1", "PYTHONUNBUFFERED": "1"}
    )
    if steps is not None:
        env[knobs.STOP_AT_STEP.name] = str(steps)
    if cwd is not None:
        env["PWD"] = str(cwd)
    return env


def start(command: Sequence[str], run: Run, steps: int | None) -> subprocess.Popen[bytes]:
    """Start the script, its output appended to the run's log, in a process group of its own
    (a kill reaches the DataLoader's workers and any wrapper shell too), in the run's working
    folder."""
    with open(run.log, "ab") as out:
        try:
            return subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment(run.root, steps, run.cwd),
                cwd=run.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise RunFailed(
                f"cannot start the command: {exc.strerror or exc}",
                where=command[0],
                fix="give the command as you run it, after --: nbresume check -- python train.py",
            ) from None


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (Linux: its state in /proc; elsewhere assumed soon)."""
    return procfs.state(pid) in (None, "T", "t", "Z", "X")


def _freeze(process: subprocess.Popen[bytes]) -> None:
    _signal(process, signal.SIGSTOP)
    waited = time.monotonic() + STOP_WAIT_S
    while not _stopped(process.pid) and time.monotonic() < waited:
        time.sleep(POLL_S)


def ended(process: subprocess.Popen[bytes]) -> bool:
    """Whether the script's first process has ended, without reaping it (see the module's
    docstring: only :func:`end_groups` reaps it)."""
    if process.returncode is not None:
        return True
    if not hasattr(os, "waitid"):  # macOS: reaped now, as subprocess does
        return process.poll() is not None
    try:
        found = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return process.poll() is not None
    return found is not None


def _wait_ended(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait until the script's first process ended (True) or ``timeout_s`` passed (False),
    without reaping it."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not ended(process):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


def _running(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the script's group still runs (without ``/proc``: whether the
    first one does)."""
    members = procfs.group_members(process.pid)
    return not ended(process) if members is None else bool(members)


def end_group(process: subprocess.Popen[bytes], grace_s: float = GRACE_S) -> int:
    """End the script's whole process group and reap its first process (:func:`end_groups`);
    return that process's exit status."""
    end_groups([process], grace_s)
    return process.wait()


def end_groups(processes: Sequence[subprocess.Popen[bytes]], grace_s: float = GRACE_S) -> None:
    """End the scripts' whole process groups, all at once, and reap their first processes.
    What still runs is sent SIGTERM (and SIGCONT, should it be stopped), then SIGKILL after
    ``grace_s`` seconds. A group ended before is left alone."""
    live = [p for p in processes if p.returncode is None]
    running = [p for p in live if _running(p)]
    for process in running:
        _signal(process, signal.SIGTERM)
        _signal(process, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while any(_running(p) for p in running) and time.monotonic() < deadline:
        time.sleep(POLL_S * 10)
    for process in live:
        # Whatever is left; the group's id is still the unreaped first process's own.
        _signal(process, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WAIT_S
    while any(_running(p) for p in live) and time.monotonic() < deadline:
        time.sleep(POLL_S * 10)
    for process in live:
        process.wait()


def finish(run: Run, process: subprocess.Popen[bytes], *, started: float, timeout_s: float) -> None:
    """Wait for the process to end on its own, then end what it left running in its group;
    raise when it fails or takes too long."""
    if not _wait_ended(process, max(0.0, started + timeout_s - time.monotonic())):
        _signal(process, signal.SIGKILL)
        end_group(process)
        raise RunFailed(
            f"{run.name} did not finish within {timeout_s:g} s; its last lines:\n{tail(run.log)}",
            fix="give it more time with --timeout, or fewer steps with --steps",
        )
    code = end_group(process)
    if code != 0:
        raise RunFailed(
            f"{run.name}: the script exited with status {code}; its last lines:\n{tail(run.log)}",
            fix="make the script run to its end on its own first (`nbresume check` runs it "
            "as given, in a working folder of each run's own that shows the current folder's "
            "files)",
        )


def tail(log: Path, lines: int = 15) -> str:
    """The last lines of a log, indented, from its last :data:`TAIL_BYTES` bytes (however
    large it is), each cut at :data:`LINE_CHARS` characters."""
    try:
        with open(log, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - TAIL_BYTES)
            handle.seek(start)
            text = handle.read(TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    shown = text.splitlines()
    if start > 0 and len(shown) > 1:
        shown = shown[1:]  # it began before the bytes read: only its end is there
    return "\n".join(f"    {_shorten(line)}" for line in shown[-lines:])


def _shorten(line: str) -> str:
    line = line.replace("\0", "")  # a log extended without writing (sparse) reads as NULs
    return line if len(line) <= LINE_CHARS else f"{line[: LINE_CHARS - 3]}..."


def run_uninterrupted(
    command: Sequence[str],
    runs: Sequence[Run],
    steps: int | None,
    timeout_s: float,
    *,
    cap_s: float | None = None,
) -> bool:
    """Uninterrupted runs, side by side. With ``cap_s``: whether they all ended within that
    many seconds (``False``: they were ended there, unfinished, and their folders are left as
    they were); a run that fails or passes ``timeout_s`` raises either way."""
    started = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for run in runs:
            processes.append(start(command, run, steps))
        for run, process in zip(runs, processes, strict=True):
            if (
                cap_s is not None
                and cap_s < timeout_s
                and not _wait_ended(process, max(0.0, started + cap_s - time.monotonic()))
            ):
                return False
            finish(run, process, started=started, timeout_s=timeout_s)
            run.legs.append(Leg(None, "done", seconds=time.monotonic() - started))
    finally:
        end_groups(processes)
    return True


def run_with_kill(
    command: Sequence[str],
    run: Run,
    steps: int,
    kill: Kill | None,
    *,
    rng: random.Random,
    timeout_s: float,
    budget: bool = True,
) -> Leg:
    """One process of the killed run: started, and killed as ``kill`` says (``None``: let it
    finish). Returns how it ended; a kill that found no moment before the final save of
    ``steps`` began lets the process finish ("done"). Without ``budget`` the script runs to
    its own end, ``steps`` being the step the uninterrupted run ended at."""
    before = look(run.root)
    stale = set(before.pending)  # what a killed process left: the next save cleans it
    leg = Leg(before.committed, "done")
    started = time.monotonic()
    process = start(command, run, steps if budget else None)
    try:
        killed = _aim(
            process, run, steps, kill, stale=stale, started=started, rng=rng, timeout_s=timeout_s
        )
        if killed is not None:
            leg.ended = "killed"
            leg.inside_save, leg.step = killed
            leg.seconds = time.monotonic() - started
            return leg
        finish(run, process, started=started, timeout_s=timeout_s)
    finally:
        end_group(process)
    leg.seconds = time.monotonic() - started
    return leg


def _aim(
    process: subprocess.Popen[bytes],
    run: Run,
    steps: int,
    kill: Kill | None,
    *,
    stale: set[str],
    started: float,
    rng: random.Random,
    timeout_s: float,
) -> tuple[bool, int | None] | None:
    """Watch the run and kill its process group as ``kill`` says; return (inside a save, the
    step) once killed, ``None`` when the moment never came (the process runs on)."""
    aimed_at: float | None = None  # when the target was committed (a kill between saves)
    while kill is not None and not ended(process):
        if time.monotonic() - started > timeout_s:
            return None  # finish() reports it
        now = look(run.root)
        saving = {n: s for n, s in now.pending.items() if n not in stale}
        if now.newest(stale) >= steps:
            return None  # the final save began: killing now could resume past step N
        due = False
        if kill.in_save:
            due = any(s >= kill.target for s in saving.values())
        elif now.committed is not None and now.committed >= kill.target:
            aimed_at = aimed_at or time.monotonic() + rng.uniform(0.0, 0.02)
            due = time.monotonic() >= aimed_at
        if not due:
            time.sleep(POLL_S)
            continue
        _freeze(process)
        still = look(run.root)
        saving = {n: s for n, s in still.pending.items() if n not in stale}
        if still.newest(stale) >= steps or (kill.in_save and not saving):
            _signal(process, signal.SIGCONT)  # the moment passed (the save committed)
            if still.newest(stale) >= steps:
                kill = None
            continue
        _signal(process, signal.SIGKILL)
        end_group(process)
        return bool(saving), max(saving.values()) if saving else still.committed
    return None


def plan_kills(count: int, last: int, rng: random.Random) -> list[Kill]:
    """``count`` kills spread over steps 2 to ``last - 1`` (fewer where there are not that
    many steps), ascending; at least one of them inside a save."""
    first = 2 if last > 3 else 1
    span = list(range(first, last))
    if not span:
        return []
    count = min(count, len(span))
    size = len(span) / count
    targets = [span[int(i * size) + rng.randrange(max(1, int(size)))] for i in range(count)]
    kinds = [rng.random() < 0.5 for _ in targets]
    kinds[rng.randrange(count)] = True  # disjoint spans: the targets are distinct, ascending
    return [Kill(t, k) for t, k in zip(targets, kinds, strict=True)]
