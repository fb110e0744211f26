"""``nbresume run``: a training command that outlives its SSH session and comes back after a
preemption.

The job runs in a session of its own (``setsid``), reads nothing (stdin is ``/dev/null``) and
appends its output to a log file itself, so a closed terminal or a dropped SSH connection
reaches neither the job nor its output. A supervisor waits for the job:

- killed by a signal from outside (SIGKILL, SIGTERM, SIGUSR1, SIGHUP), or exited with the
  status 128+N that a process stopped by one of them reports (the Checkpointer's own stop):
  a preemption or a kill. The identical command is started again after a short pause, up to
  ``--retries`` times, and resumes from the newest verified checkpoint.
- a Python exception, a full disk, the out-of-memory killer: not retried, because the same
  command would fail the same way. The last lines say why and what to do.
- a job that asked Slurm to requeue it: not retried here, since Slurm starts it again.

Signals sent to the supervisor itself (SIGTERM, SIGINT, SIGUSR1) are passed on to the job,
which saves at its next step boundary and stops; there is no retry after that. SIGHUP is
ignored: it is what a lost terminal sends.

Next to the log, a run-state file (``<log>.state.json``) records the command, the supervisor's
and the job's process ids with their start times, the attempts, and how the run ended.
``nbresume status`` judges liveness from those processes and the age of the newest
checkpoint, never from the log's last line.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

from nbresume.checkpoint import procfs
from nbresume.checkpoint.backends import open_store
from nbresume.checkpoint.format import created_time
from nbresume.checkpoint.store import CheckpointStore
from nbresume.checkpoint.units import format_duration
from nbresume.errors import NbresumeError, UsageError
from nbresume.platforms.cgroup import _THREAD_VARIABLES, read_cpu, read_memory
from nbresume.slurm import REQUEUED_MARK

MARK = "[nbresume run]"
DEFAULT_LOG_NAME = "nbresume-run.log"
STATE_SUFFIX = ".state.json"
STATE_FORMAT = "nbresume-run"
STATE_VERSION = 1
#: How much of the end of an attempt's output is read to tell why it failed.
TAIL_BYTES = 64 << 10
MAX_BACKOFF_S = 60.0
#: How long ``--detach`` waits for the supervisor to report the job started.
DETACH_TIMEOUT_S = 60.0

#: Signals that end a job from outside without anything being wrong with it: a kill or a
#: preemption (SIGKILL, SIGTERM), Slurm's warning before the time limit (SIGUSR1), a lost
#: terminal (SIGHUP).
RETRIED_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP})
#: Signals the supervisor passes on to the job.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

_DISK_FULL = re.compile(
    r"No space left on device|Disk quota exceeded|\[Errno 28\]|\[Errno 122\]|ENOSPC|"
    r"StorageFullError"
)
_TRACEBACK = "Traceback (most recent call last):"


# -- the run-state file ------------------------------------------------------------------------


@dataclass
class RunState:
    """What ``nbresume run`` records about a run, next to its log."""

    command: list[str]
    log: str
    cwd: str
    dir: str | None = None
    retries: int = 3
    backoff: float = 5.0
    host: str = field(default_factory=socket.gethostname)
    boot_id: str = ""
    started: float = field(default_factory=time.time)
    #: starting | running | waiting (to retry) | exited
    status: str = "starting"
    supervisor_pid: int | None = None
    supervisor_start: int | None = None
    pid: int | None = None
    #: The job's start time in clock ticks since boot (/proc/PID/stat): a pid that the kernel
    #: gave to another process since has another start time.
    pid_start: int | None = None
    pgid: int | None = None
    attempt: int = 0
    attempt_started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    exit_signal: str | None = None
    reason: str = ""

    @property
    def attempts_allowed(self) -> int:
        return self.retries + 1

    def to_json(self) -> str:
        document = {"format": STATE_FORMAT, "version": STATE_VERSION, **asdict(self)}
        return json.dumps(document, indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> RunState:
        """The state in ``path``; raises :class:`UsageError` when it is not a run-state file."""
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"not a readable run-state file: {exc}", where=str(path)) from None
        if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
            raise UsageError("not an nbresume run-state file", where=str(path))
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in document.items() if k in known})
        except TypeError as exc:
            raise UsageError(f"incomplete run-state file: {exc}", where=str(path)) from None

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically, so that a reader never sees half a file."""
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(self.to_json(), encoding="utf-8")
        os.replace(temp, path)


def state_path(log: Path) -> Path:
    """The run-state file that belongs to ``log``."""
    return log.with_name(log.name + STATE_SUFFIX)


def copy_log(log: Path, location: str) -> str:
    """Copy ``log`` into the checkpoint folder ``location`` (a path or a URL) as
    :data:`DEFAULT_LOG_NAME`, replacing an older copy; return ``""`` or what went wrong."""
    if "://" not in location and Path(location).expanduser().absolute() / DEFAULT_LOG_NAME == log:
        return ""  # written there already
    try:
        open_store(location).replace_small(DEFAULT_LOG_NAME, log.read_bytes())
    except (NbresumeError, OSError, ValueError) as exc:
        return f"the log could not be copied to {location}: {exc}"
    return ""


def default_log(ckpt_dir: str | None) -> Path:
    """``<checkpoint folder>/nbresume-run.log`` for a local folder, else ``./nbresume-run.log``."""
    if ckpt_dir and "://" not in ckpt_dir:
        return Path(ckpt_dir).expanduser().absolute() / DEFAULT_LOG_NAME
    return Path.cwd() / DEFAULT_LOG_NAME


# -- processes ---------------------------------------------------------------------------------


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, where /proc tells."""
    return procfs.start_ticks(pid)


def group_alive(pgid: int | None) -> bool:
    """Whether any process of the process group ``pgid`` is left."""
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_environment(base: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The job's environment, and a note on what was set: unbuffered Python output (a log
    off a terminal is block-buffered), and math thread pools sized to the container's CPU
    quota (torch and OpenMP size them by the host's cores). Variables already set win."""
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    cpu = read_cpu()
    if cpu.quota is None:
        return env, ""
    capped = [v for v in _THREAD_VARIABLES if v not in env]
    for variable in capped:
        env[variable] = str(cpu.usable)
    if not capped:
        return env, ""
    return env, (
        f"math threads capped to {cpu.usable} (CPU quota {cpu.quota:g} of {cpu.host} cores): "
        + ", ".join(f"{v}={cpu.usable}" for v in capped)
    )


# -- why an attempt ended ----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, and whether the same command is worth starting again."""

    code: int  # as a shell reports it: 128+N for a process killed by signal N
    signal: int | None
    retry: bool
    reason: str

    @property
    def headline(self) -> str:
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exit {self.code}"


_RESUME_HINT = "run the same command again: it resumes from the newest verified checkpoint"


def classify(returncode: int, tail: str, *, oom_killed: bool = False) -> Outcome:
    """Why the job ended (``returncode`` as :class:`subprocess.Popen` reports it, ``tail`` the
    end of its output), and whether to retry."""
    killed = -returncode if returncode < 0 else None
    code = 128 + killed if killed is not None else returncode
    by_signal = killed if killed is not None else (code - 128 if 128 < code < 160 else None)
    if returncode == 0:
        return Outcome(0, None, False, "")
    if REQUEUED_MARK in tail:
        return Outcome(code, killed, False, "the job asked Slurm to requeue it: Slurm starts "
                       "it again, so it is not started again here")  # fmt: skip
    if oom_killed:
        return _not_retried(
            code,
            killed,
            "the out-of-memory killer ended it (the container's memory limit)",
            "the same command would run out of memory again; lower the batch size or the "
            "number of DataLoader workers, or ask for more memory",
        )
    if by_signal in RETRIED_SIGNALS:
        name = signal.Signals(by_signal).name
        return Outcome(code, killed, True, f"{name} came from outside the job (a preemption, "
                       "a kill, a lost terminal)")  # fmt: skip
    if _DISK_FULL.search(tail):
        return _not_retried(
            code,
            killed,
            "the disk is full (No space left on device)",
            "the same command would fail the same way; free space there (`nbresume prune DIR "
            "--keep 2`, caches, old logs) or choose a larger disk",
        )
    if _TRACEBACK in tail:
        return _not_retried(
            code,
            killed,
            f"the job failed with a Python exception ({last_exception(tail)})",
            "the same command would fail the same way; fix the code",
        )
    if killed is not None:
        return _not_retried(
            code,
            killed,
            f"it crashed with {signal.Signals(killed).name}",
            "a crash in native code usually repeats; read the log",
        )
    return Outcome(code, None, False, (
        f"exit status {code} is neither a preemption nor a kill: not retried; read the log, "
        f"then {_RESUME_HINT}"
    ))  # fmt: skip


def _not_retried(code: int, killed: int | None, what: str, why_and_fix: str) -> Outcome:
    """The end of a job that a retry would not mend: ``what`` ended it, why it would end the
    same way again and what to do before the same command resumes it."""
    return Outcome(code, killed, False, f"{what}: not retried, {why_and_fix}, then {_RESUME_HINT}")


def last_exception(tail: str) -> str:
    """The exception line of the last Python traceback in ``tail``."""
    after = tail.rsplit(_TRACEBACK, 1)[-1]
    lines = [line for line in after.splitlines() if line.strip() and not line[0].isspace()]
    text = lines[-1].strip() if lines else "unknown"
    return text if len(text) <= 200 else text[:197] + "..."


# -- the supervisor ----------------------------------------------------------------------------


class Supervisor:
    """Runs the job, retries it after a preemption, and keeps the run-state file current."""

    def __init__(self, state: RunState, path: Path, *, echo: BinaryIO | None = None) -> None:
        self.state = state
        self.path = path
        self.log_path = Path(state.log)
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.forwarded: int | None = None  # the stop signal passed on to the job
        self.interrupted = False
        self.wake = threading.Event()

    def say(self, text: str, *, stamp: bool = True) -> None:
        """Append a line of the supervisor's to the log the job writes to (both append)."""
        when = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S ") if stamp else ""
        with open(self.log_path, "ab") as log:
            log.write(f"{MARK} {when}{text}\n".encode())

    def save(self) -> None:
        self.state.write(self.path)

    def run(self) -> int:
        """Supervise until the job ends for good; return its exit status."""
        previous = self._install_handlers()
        follower = _Follower(self.log_path, self.echo) if self.echo is not None else None
        try:
            return self._loop()
        finally:
            if follower is not None:
                follower.stop()
            for signum, handler in previous.items():
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(signum, handler)

    def _loop(self) -> int:
        env, note = job_environment()
        if note:
            self.say(note)
        command = shlex.join(self.state.command)
        while True:
            self.state.attempt += 1
            attempt = self.state.attempt
            self.say(
                f"attempt {attempt} of {self.state.attempts_allowed}: {command} "
                f"(in {self.state.cwd}; {self._newest_checkpoint()})"
            )
            offset = self.log_path.stat().st_size
            oom_before = _oom_kills()
            started = time.time()
            try:
                with open(self.log_path, "ab") as log:
                    self.proc = subprocess.Popen(
                        self.state.command,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=self.state.cwd,
                        env=env,
                        start_new_session=True,
                    )
            except OSError as exc:
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                reason = f"cannot start the command: {exc}"
                return self._finish(Outcome(code, None, False, reason), started)
            if self.forwarded is not None:  # a stop signal came while the job was starting
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, self.forwarded)
            self.state.status = "running"
            self.state.pid = self.proc.pid
            self.state.pgid = self.proc.pid  # a new session: the job leads its own group
            self.state.pid_start = process_start(self.proc.pid)
            self.state.attempt_started = started
            self.save()
            returncode = self._wait()
            outcome = classify(
                returncode,
                _read_tail(self.log_path, offset),
                oom_killed=_oom_kills() > oom_before,
            )
            if self.forwarded is not None and outcome.code != 0:
                name = signal.Signals(self.forwarded).name
                outcome = Outcome(outcome.code, outcome.signal, False, (
                    f"stopped on request: the supervisor received {name} and passed it on to "
                    f"the job; to continue, {_RESUME_HINT}"
                ))  # fmt: skip
            if not (outcome.retry and attempt <= self.state.retries and not self.stopping):
                return self._finish(outcome, started)
            # What is left of the job (DataLoader workers) must be gone before the next
            # attempt, or two copies would write the same checkpoints.
            _end_group(self.proc.pid)
            delay = min(MAX_BACKOFF_S, self.state.backoff * 2 ** (attempt - 1))
            ran = format_duration(time.time() - started, compact=True)
            self.say(
                f"{outcome.headline} after {ran}: "
                f"{outcome.reason}; starting the same command again in "
                f"{format_duration(delay, compact=True) if delay >= 1 else f'{delay:.1f}s'} "
                f"(attempt {attempt + 1} of {self.state.attempts_allowed})"
            )
            self.state.status = "waiting"
            self.state.exit_code = outcome.code
            self.save()
            self._copy_log()
            self.wake.wait(delay)
            if self.stopping:
                name = signal.Signals(self.forwarded or signal.SIGTERM).name
                reason = f"stopped on request ({name}) before the next attempt; {_RESUME_HINT}"
                return self._finish(Outcome(outcome.code, outcome.signal, False, reason), started)

    def _wait(self) -> int:
        assert self.proc is not None
        while True:
            try:
                return self.proc.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries, belt and braces
                continue

    def _finish(self, outcome: Outcome, started: float) -> int:
        if outcome.retry:
            outcome = Outcome(outcome.code, outcome.signal, False, (
                f"{outcome.reason}: no retries left (--retries {self.state.retries}); "
                f"{_RESUME_HINT}"
            ))  # fmt: skip
        if outcome.reason:
            self.say(outcome.reason)
        # The last line, with a fixed shape that scripts can match.
        total = format_duration(time.time() - self.state.started, compact=True)
        self.say(f"{outcome.headline} after {total}", stamp=False)
        self.state.status = "exited"
        self.state.ended = time.time()
        self.state.exit_code = outcome.code
        self.state.exit_signal = signal.Signals(outcome.signal).name if outcome.signal else None
        self.state.reason = outcome.reason
        self.save()
        self._copy_log()
        return outcome.code

    def _copy_log(self) -> None:
        """The log, copied next to the checkpoints when it is written elsewhere: a machine
        that is torn down takes its disk, and the log, with it. Done when an attempt ends."""
        if self.state.dir:
            problem = copy_log(self.log_path, self.state.dir)
            if problem:
                self.say(problem)

    def _newest_checkpoint(self) -> str:
        if not self.state.dir:
            return "no --dir given"
        from nbresume.frameworks.layout import local_kind

        framework = local_kind(self.state.dir)  # a Trainer's output_dir, a Lightning dirpath
        if framework is not None:
            return _framework_newest(*framework)
        try:
            latest = CheckpointStore(self.state.dir, keep=None).latest()
        except (NbresumeError, OSError, ValueError) as exc:
            return f"cannot list {self.state.dir}: {exc}"
        if latest is None:
            return f"no checkpoint in {self.state.dir} yet"
        return f"newest checkpoint: step {latest.step}"

    # -- signals -------------------------------------------------------------------------------

    def _install_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous
        with contextlib.suppress(ValueError, OSError):
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        for signum in FORWARDED_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                previous[signum] = signal.signal(signum, self._forward)
        return previous

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        """Pass a stop signal on to the job (it saves at the next step boundary) and stop
        retrying. A second interrupt kills the job's whole process group."""
        self.stopping = True
        self.forwarded = signum
        self.wake.set()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            if signum == signal.SIGINT and self.interrupted:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signum)
        except ProcessLookupError:
            return
        if signum == signal.SIGINT:
            self.interrupted = True
            if self.echo is not None:
                with contextlib.suppress(OSError):
                    self.echo.write(
                        f"\n{MARK} passed the interrupt on to the job: it saves at its next "
                        "step boundary and stops; interrupt again to kill it at once\n".encode()
                    )
                    self.echo.flush()


class _Follower:
    """Copies what the log gains to the terminal, until the terminal goes away."""

    def __init__(self, path: Path, out: BinaryIO) -> None:
        self.path = path
        self.out = out
        self.offset = path.stat().st_size if path.exists() else 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nbresume-log", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.2):
            if not self._copy():
                return
        self._copy()

    def _copy(self) -> bool:
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except OSError:
            return True
        if not data:
            return True
        self.offset += len(data)
        try:
            self.out.write(data)
            self.out.flush()
        except (OSError, ValueError):
            return False  # the terminal is gone (a dropped SSH session): the job goes on
        return True

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def _read_tail(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - TAIL_BYTES))
            return log.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _oom_kills() -> int:
    try:
        return read_memory().oom_kills or 0
    except OSError:
        return 0


def _end_group(pgid: int, grace: float = 5.0) -> None:
    """Kill what is left of the job's process group and wait until it is gone."""
    if not group_alive(pgid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- starting a run ----------------------------------------------------------------------------


def prepare(
    command: Sequence[str],
    *,
    log: str | None = None,
    ckpt_dir: str | None = None,
    retries: int = 3,
    backoff: float = 5.0,
) -> tuple[RunState, Path]:
    """The run's state and the path of its state file; refuses to start a second job on the
    same log while the first is alive."""
    if not command:
        raise UsageError("no command to run", fix="nbresume run [OPTIONS] -- CMD ...")
    log_path = Path(log).expanduser().absolute() if log else default_log(ckpt_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    path = state_path(log_path)
    if path.exists():
        with contextlib.suppress(UsageError):
            old = RunState.read(path)
            if (
                old.status != "exited"
                and old.host == socket.gethostname()
                and (
                    procfs.process_runs(old.supervisor_pid, old.supervisor_start)
                    or procfs.process_runs(old.pid, old.pid_start)
                )
            ):
                raise NbresumeError(
                    f"a run is already going on with this log: {shlex.join(old.command)} "
                    f"(supervisor pid {old.supervisor_pid}, job pid {old.pid})",
                    where=str(log_path),
                    fix="two copies would write the same checkpoints: stop it first (kill "
                    f"{old.supervisor_pid}), or give another --log",
                )
    if ckpt_dir and "://" not in ckpt_dir:
        ckpt_dir = str(Path(ckpt_dir).expanduser().absolute())
    state = RunState(
        command=list(command),
        log=str(log_path),
        cwd=os.getcwd(),
        dir=ckpt_dir,
        retries=retries,
        backoff=backoff,
        boot_id=procfs.boot_id(),
    )
    return state, path


def run_attached(state: RunState, path: Path) -> int:
    """Supervise in this process, copying the log to the terminal. A lost terminal stops the
    copying, not the job nor the supervision."""
    state.supervisor_pid = os.getpid()
    state.supervisor_start = process_start(os.getpid())
    state.write(path)
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    return Supervisor(state, path, echo=out).run()


def run_detached(state: RunState, path: Path, *, out: Callable[[str], None] = print) -> int:
    """Start a detached supervisor and return once it reports the job started."""
    state.write(path)
    package_parent = str(Path(__file__).resolve().parents[1])
    # -c rather than -m: the supervisor must find nbresume even where it is not installed,
    # without the job inheriting a changed PYTHONPATH.
    code = (
        f"import sys; sys.path.insert(0, {package_parent!r}); "
        "from nbresume.runner import supervise_main; sys.exit(supervise_main(sys.argv[1:]))"
    )
    with open(state.log, "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-c", code, str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=state.cwd,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + DETACH_TIMEOUT_S
    current = state
    while time.monotonic() < deadline:
        with contextlib.suppress(UsageError):
            current = RunState.read(path)
        if current.status != "starting":
            break
        if supervisor.poll() is not None:
            break
        time.sleep(0.05)
    if current.status == "starting" or (current.status == "exited" and not current.pid):
        detail = current.reason or f"see {state.log}"
        out(f"nbresume run: the job did not start: {detail}")
        return current.exit_code or 1
    out(
        f"nbresume run: started in the background: {shlex.join(state.command)}\n"
        f"  job pid {current.pid}, supervisor pid {current.supervisor_pid} "
        f"(retries {state.retries})\n"
        f"  log:    {state.log}\n"
        f"  status: nbresume status {Path(state.log).parent}\n"
        f"  stop:   kill {current.supervisor_pid}  (the job saves at its next step boundary)"
    )
    return 0


def supervise_main(argv: Sequence[str]) -> int:
    """Entry point of the detached supervisor: ``<state file>``."""
    path = Path(argv[0])
    state = RunState.read(path)
    state.supervisor_pid = os.getpid()
    state.supervisor_start = process_start(os.getpid())
    state.write(path)
    return Supervisor(state, path).run()


# -- nbresume status ---------------------------------------------------------------------------


def find_state(folder: Path) -> tuple[RunState, Path] | None:
    """The most recently started run recorded in ``folder``, if any."""
    found: list[tuple[float, RunState, Path]] = []
    for candidate in folder.glob(f"*{STATE_SUFFIX}"):
        with contextlib.suppress(UsageError):
            state = RunState.read(candidate)
            found.append((state.started, state, candidate))
    if not found:
        return None
    _, state, path = max(found, key=lambda item: item[0])
    return state, path


def status(target: str, *, now: float | None = None) -> tuple[list[str], int]:
    """Lines describing the run in ``target`` (its folder, or its checkpoint folder) and the
    exit status: 0 when it is alive or finished well and its newest checkpoint verifies."""
    now = time.time() if now is None else now
    lines: list[str] = []
    healthy = True
    recorded: tuple[RunState, Path] | None = None
    local = "://" not in target or target.startswith("file://")
    folder = Path(target.removeprefix("file://")).expanduser()
    if local and not folder.exists():
        raise UsageError("no such folder", where=target)
    if local and folder.is_dir():
        recorded = find_state(folder)
    ckpt_dir: str | None = target
    reference = None  # when the job last (re)started: a checkpoint cannot be older than that
    if recorded is not None:
        state, _ = recorded
        ckpt_dir = state.dir or (target if _has_checkpoints(target) else None)
        verdict, healthy, reference = _judge_process(state, now)
        lines.append(f"run:        {shlex.join(state.command)}")
        lines.append(
            f"            started {_ago(now - state.started)} on {state.host}, "
            f"attempt {state.attempt} of {state.attempts_allowed}"
        )
        lines.append(f"process:    {verdict}")
    else:
        lines.append(
            "process:    unknown: no run record here (`nbresume run` writes "
            f"<log>{STATE_SUFFIX} next to its log)"
        )
    if ckpt_dir is None:
        lines.append("checkpoint: unknown (the run was started without --dir)")
    else:
        said, ok, alive_but_stale = _judge_checkpoint(ckpt_dir, now, reference)
        lines.append(f"checkpoint: {said[0]}")
        lines.extend(f"            {line}" for line in said[1:])
        healthy = healthy and ok
        if alive_but_stale and recorded is not None and recorded[0].status == "running":
            lines.append(f"            {alive_but_stale}")
    if recorded is not None:
        lines.append(f"log:        {recorded[0].log}")
    return lines, 0 if healthy else 1


def _has_checkpoints(location: str) -> bool:
    from nbresume.frameworks.layout import local_kind

    if local_kind(location) is not None:  # a Trainer's output_dir, a Lightning dirpath
        return True
    with contextlib.suppress(NbresumeError, OSError):
        return CheckpointStore(location, keep=None).latest() is not None
    return False


def _ago(seconds: float) -> str:
    return f"{format_duration(seconds)} ago"


def _judge_process(state: RunState, now: float) -> tuple[str, bool, float | None]:
    """(what the processes say, whether that is healthy, when the current attempt began)."""
    if state.status == "exited":
        ended = _ago(now - (state.ended or now))
        how = f"killed by {state.exit_signal}" if state.exit_signal else f"exit {state.exit_code}"
        if state.exit_code == 0:
            return f"finished: exit 0, {ended}", True, None
        return f"ended: {how}, {ended}: {state.reason}", False, None
    if state.host != socket.gethostname():
        return (
            f"recorded as {state.status} on {state.host}; this is {socket.gethostname()}, "
            "so its processes cannot be checked from here: judge by the checkpoint age",
            True,
            state.attempt_started,
        )
    if state.boot_id and procfs.boot_id() and state.boot_id != procfs.boot_id():
        return (
            "not running: the machine restarted since the run began, which ended it; run the "
            "same command again to resume",
            False,
            None,
        )
    job = procfs.process_runs(state.pid, state.pid_start)
    supervisor = procfs.process_runs(state.supervisor_pid, state.supervisor_start)
    since = format_duration(now - (state.attempt_started or state.started))
    if job and supervisor:
        return (
            f"running: pid {state.pid} for {since} (supervisor pid {state.supervisor_pid})",
            True,
            state.attempt_started,
        )
    if job:
        return (
            f"running: pid {state.pid} for {since}, but its supervisor is gone: it will not be "
            "started again if it is killed",
            True,
            state.attempt_started,
        )
    if supervisor and state.status in ("waiting", "running", "starting"):
        return (
            f"between attempts: the supervisor (pid {state.supervisor_pid}) starts the command "
            "again shortly",
            True,
            None,
        )
    return (
        "not running: the job and its supervisor are gone without a final status (killed "
        "with SIGKILL, or the machine went down); run the same command again to resume",
        False,
        None,
    )


def _judge_checkpoint(
    location: str, now: float, started: float | None
) -> tuple[list[str], bool, str]:
    """(what the newest checkpoint is and its age, as lines; whether it verifies; a note when
    the job runs but has not saved for much longer than usual)."""
    from nbresume.frameworks.layout import local_kind

    framework = local_kind(location)  # a Trainer's output_dir, a Lightning dirpath
    if framework is not None:
        return _judge_framework(*framework, now, started)
    store = CheckpointStore(location, keep=None)
    try:
        infos = store.list()
    except (NbresumeError, OSError) as exc:
        return [f"cannot list {location}: {exc}"], False, ""
    if not infos:
        return [f"none yet in {location}"], True, ""
    newest = infos[-1]
    result = store.verify(newest.step).results[0]
    created = created_time(newest.created)
    age = f", {format_duration(now - created)} old" if created else ""
    if not result.ok:
        return [f"step {newest.step} does NOT verify{age}: {result.problem}"], False, ""
    text = f"step {newest.step} verified{age} ({result.location})"
    return [text], True, _stuck(created, [i.created for i in infos], now, started)


def _judge_framework(
    path: Path, kind: str, now: float, started: float | None
) -> tuple[list[str], bool, str]:
    """:func:`_judge_checkpoint` of a framework's folder: the checkpoint that framework's own
    resume takes (every file of it read back), and the newer ones it passes over."""
    from nbresume.frameworks.layout import DESCRIPTION, RESUME
    from nbresume.frameworks.resumable import resumable

    try:
        found = resumable(path, kind)
    except (NbresumeError, OSError) as exc:
        return [f"cannot read {path} ({DESCRIPTION[kind]}): {exc}"], False, ""
    resume = f"{DESCRIPTION[kind]}: {RESUME[kind]}"
    if found.path is None:
        first = f"none verifies in {path}" if found.passed_over else f"none yet in {path}"
        lines = [first, f"{resume} finds none: a run starts from scratch"]
    else:
        created = created_time(found.created)
        age = f", {format_duration(now - created)} old" if created else ""
        lines = [
            f"step {found.step} verified{age} ({found.path})",
            f"{resume} resumes from {found.path.name}",
        ]
    for passed in found.passed_over:
        verdict = " does NOT verify" if passed.committed else ""
        lines.append(
            f"passed over: {passed.path.name} (step {passed.step}){verdict}: {passed.problem}"
        )
    # A committed checkpoint that does not verify is damage; a folder without a manifest may
    # be a save in progress (an nbresume folder does not list those at all).
    ok = not any(passed.committed for passed in found.passed_over)
    if found.path is None:
        return lines, ok, ""
    return lines, ok, _stuck(created_time(found.created), list(found.created_times), now, started)


def _framework_newest(path: Path, kind: str) -> str:
    """The restart line's words for a framework's folder: what its own resume takes."""
    from nbresume.frameworks.layout import NAME, RESUME
    from nbresume.frameworks.resumable import resumable

    try:
        found = resumable(path, kind)
    except (NbresumeError, OSError) as exc:
        return f"cannot read {path}: {exc}"
    broken = sum(passed.committed for passed in found.passed_over)
    passed = f"; {broken} newer one(s) do NOT verify" if broken else ""
    if found.path is None:
        return f"no verified checkpoint in {path} yet ({NAME[kind]}{passed})"
    return (
        f"newest verified checkpoint: {found.path.name}, step {found.step} ({NAME[kind]}: "
        f"{RESUME[kind]} resumes from it{passed})"
    )


def _stuck(created: float | None, times: list[str], now: float, started: float | None) -> str:
    """A note when no checkpoint came for much longer than the usual time between the recent
    ones (``times``: when each checkpoint was saved, oldest first); ``""`` otherwise."""
    stamps = [t for t in (created_time(c) for c in times[-6:]) if t]
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps) if b > a)
    if not created or not gaps:
        return ""
    usual = gaps[len(gaps) // 2]
    quiet = now - max(created, started or 0.0)
    if quiet <= max(3 * usual, 300):
        return ""
    return (
        f"no new checkpoint for {format_duration(quiet)}, while they came every "
        f"{format_duration(usual)} before: the job may be stuck; look at the log"
    )
