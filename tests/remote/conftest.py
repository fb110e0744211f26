"""Fixtures for the remote tests: real processes, a real sshd on loopback, a clean environment.

The Python processes (``nbresume run``, ``nbresume pull``, the training job) are forked from the
suite's warm server (testkit.warmfork), each a process of its own with its pid, session and
exit status: what these tests check is what the processes do, not how an interpreter starts.

Every child process gets an environment without Slurm, Kubernetes, SSH agent or nbresume
variables, and a cgroup root with no limits, so that what a test sees does not depend on the
machine that runs it. Processes that a test leaves behind (a detached run that a failed
assertion never waited for) are ended at teardown, by the pids their run-state files record.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from nbresume.checkpoint.procfs import process_runs
from nbresume.checkpoint.store import CheckpointStore
from nbresume.runner import RunState, state_path
from testkit import warmfork
from testkit.ports import free_port

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_job.py"
STANDINS = HERE / "bin"
#: Longest any child may take before the test gives up on it (a hang guard, not a timing).
HANG_S = 120.0


def wait_until(predicate: Callable[[], object], what: str, timeout: float = HANG_S) -> None:
    """Poll until ``predicate()`` is true; fail naming ``what`` if it never becomes so."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.03)


def read_state(log: Path) -> RunState | None:
    try:
        return RunState.read(state_path(log))
    except Exception:
        return None


def log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


MARKER = re.compile(
    r"\[nbresume run\] (exit \d+|killed by SIG[A-Z0-9]+) after \d+(s|m\d\ds|h\d\dm)"
)


def final_marker(log: Path) -> str:
    """The last line of a finished run's log, checked to have the marker's shape."""
    last = log_lines(log)[-1]
    assert MARKER.fullmatch(last), f"the log does not end with the marker line: {last!r}"
    return last


@pytest.fixture
def child_env(tmp_path: Path) -> dict[str, str]:
    """The environment for child processes (see the module docstring)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "KUBERNETES_", "NBRESUME_", "SSH_", "SCONTROL_"))
        and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    }
    no_limits = tmp_path / "cgroup-without-limits"
    no_limits.mkdir(exist_ok=True)
    env["NBRESUME_CGROUP_ROOT"] = str(no_limits)
    env["PATH"] = f"{STANDINS}{os.pathsep}{env.get('PATH', '')}"
    env["SCONTROL_RECORD"] = str(tmp_path / "scontrol-calls.txt")
    return env


@pytest.fixture(autouse=True)
def end_leftovers(tmp_path: Path) -> Iterator[None]:
    """After the test, kill what its runs left running (only processes they recorded)."""
    yield
    for path in tmp_path.rglob("*.state.json"):
        try:
            state = RunState.read(path)
        except Exception:
            continue
        if process_runs(state.supervisor_pid, state.supervisor_start):
            with contextlib.suppress(OSError):
                os.kill(state.supervisor_pid or 0, signal.SIGKILL)
        if state.pgid and process_runs(state.pid, state.pid_start):
            with contextlib.suppress(OSError):
                os.killpg(state.pgid, signal.SIGKILL)


@dataclass
class Job:
    """A child process whose output lines are collected as they come."""

    proc: subprocess.Popen[str] | warmfork.WarmProcess
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.endswith("\n"):
                break  # killed mid-print: a partial line says nothing
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, line: str) -> None:
        wait_until(
            lambda: line in self.lines or self.proc.poll() is not None,
            f"the line {line!r} from {self.proc.args}",
        )
        assert line in self.lines, f"the process ended before {line!r}:\n{self.output}"

    def finish(self) -> int:
        code = self.proc.wait(timeout=HANG_S)
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def steps(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("step ")]


def start_job(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Job:
    """A Python process (``argv`` starts with ``sys.executable``), its output collected."""
    proc = warmfork.popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
    )
    return Job(proc)


def train_argv(folder: Path, total: int, *extra: str) -> list[str]:
    return [sys.executable, str(TRAIN), str(folder), "--total", str(total), *extra]


def verified_steps(folder: Path | str) -> dict[int, bool]:
    """Every checkpoint of ``folder``: step -> whether it verifies."""
    report = CheckpointStore(folder, keep=None).verify()
    return {r.step: r.ok for r in report.results}


# -- a real sshd on loopback -------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class SshServer:
    """OpenSSH's sshd on 127.0.0.1, with its own host key and one authorized user key.

    ``home`` is a home folder whose ``.ssh/config`` names the server ``sshbox`` (host, port,
    user and identity file), as a user's would: point HOME at it.
    """

    folder: Path
    port: int
    user: str
    home: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def remote_home(self) -> Path:
        """Where SFTP sessions start (the remote side's home, as SFTP sees it)."""
        return self.folder / "remote-home"

    @property
    def config(self) -> Path:
        return self.folder / "sshd_config"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "sshd.log", "ab"),  # noqa: SIM115 (the child owns it)
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.folder / "sshd.log").read_text(errors="replace")
                pytest.skip(f"sshd could not start here: {log.strip()[-500:]}")
            with socket.socket() as sock, contextlib.suppress(OSError):
                sock.settimeout(0.5)
                sock.connect(("127.0.0.1", self.port))
                return
            time.sleep(0.05)
        self.stop()
        pytest.skip("sshd did not accept connections within 15 s")

    def stop(self) -> None:
        """End sshd and every connection it serves at once (as a network drop does)."""
        if self.process is None:
            return
        # Each connection is served by a child that starts a session of its own: find them
        # through their parents, not by process group.
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def url(self, path: Path) -> str:
        return f"ssh://sshbox{path}"


@pytest.fixture(scope="session")
def ssh_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a host key pair and a user key pair (ssh-keygen, ed25519)."""
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("OpenSSH's sshd is not installed (scripts/setup installs openssh-server)")
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        pytest.skip("ssh-keygen is not installed")
    pytest.importorskip("paramiko", reason="paramiko is not installed: pip install -e '.[ssh]'")
    folder = tmp_path_factory.mktemp("ssh-keys")
    for name in ("host_key", "user_key", "other_host_key"):
        subprocess.run(
            [keygen, "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(folder / name)],
            check=True,
            timeout=30,
        )
    return folder


@pytest.fixture
def sshd(ssh_keys: Path, tmp_path: Path) -> Iterator[SshServer]:
    """A running sshd (see :class:`SshServer`); stopped after the test."""
    if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
        # sshd started by root insists on its privilege separation folder, which the system
        # service would create.
        try:
            Path("/run/sshd").mkdir(mode=0o755, parents=True)
        except OSError as exc:
            pytest.skip(f"sshd needs /run/sshd, which cannot be created: {exc}")
    folder = tmp_path / "sshd"
    (folder / "remote-home").mkdir(parents=True)
    user = getpass.getuser()
    port = free_port()
    authorized = folder / "authorized_keys"
    authorized.write_text((ssh_keys / "user_key.pub").read_text())
    (folder / "sshd_config").write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {ssh_keys / 'host_key'}\n"
        f"AuthorizedKeysFile {authorized}\n"
        "PidFile none\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\n"
        # SFTP starts here, standing in for the remote user's home: relative paths resolve
        # from it, and the tests write nothing into the real home folder.
        f"Subsystem sftp internal-sftp -d {folder / 'remote-home'}\n"
        "LogLevel ERROR\n"
    )
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        "Host sshbox\n"
        "  HostName 127.0.0.1\n"
        f"  Port {port}\n"
        f"  User {user}\n"
        f"  IdentityFile {ssh_keys / 'user_key'}\n"
    )
    server = SshServer(folder, port, user, home)
    server.start()
    yield server
    server.stop()


def remote_run(folder: Path, *, big: int = 4 << 20) -> dict[int, Path]:
    """Three committed checkpoints as a training run leaves them: steps 100 and 200 small,
    step 300 with a model file of ``big`` bytes. Returns step -> checkpoint folder."""
    store = CheckpointStore(folder, keep=None)
    rng = np.random.default_rng(0)
    out = {}
    for step, floats in ((100, 1000), (200, 1000), (300, big // 4)):
        info = store.save(
            step,
            tensors={"model": {"w": rng.standard_normal(floats).astype(np.float32)}},
            data={"state": {"step": step}},
            metrics={"loss": 1.0 / step},
        )
        out[step] = Path(info.location)
    return out
