"""``nbresume run``: the job outlives its terminal, comes back after a kill, and is not started
again when starting it again cannot help.

Every test runs the real command in child processes and kills real processes; the outcome is
read from the log and the run-state file, as a user (or ``nbresume status``) reads them.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbresume.checkpoint.procfs import process_runs
from testkit import warmfork
from testkit.cli import nbresume_argv

from .conftest import (
    HANG_S,
    final_marker,
    log_lines,
    read_state,
    start_job,
    train_argv,
    verified_steps,
    wait_until,
)

#: A job that reports how it was started, waits for the file named by its argument, then ends.
WAITING_JOB = """
import os, sys, time
print("stdin", os.path.realpath("/proc/self/fd/0"))
print("unbuffered", os.environ.get("PYTHONUNBUFFERED"))
print("threads", os.environ.get("OMP_NUM_THREADS"))
print("session leader", os.getsid(0) == os.getpid())
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("finished")
"""


def waiting_job(tmp_path: Path) -> tuple[list[str], Path]:
    script = tmp_path / "waiting_job.py"
    script.write_text(WAITING_JOB)
    go = tmp_path / "go"
    return [sys.executable, str(script), str(go)], go


def wait_for_state(log: Path, status: str) -> None:
    wait_until(
        lambda: (s := read_state(log)) is not None and s.status == status,
        f"the run to be {status!r}",
    )


def test_a_detached_run_outlives_the_command_that_started_it(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    job, go = waiting_job(tmp_path)
    log = tmp_path / "logs" / "train.log"

    parent = warmfork.run(
        nbresume_argv("run", "--detach", "--log", str(log), "--", *job),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )

    assert parent.returncode == 0, parent.stdout + parent.stderr
    assert "started in the background" in parent.stdout
    state = read_state(log)
    assert state is not None
    assert state.status == "running"
    # The command that started it is gone; the job is not (it waits for the go file).
    assert process_runs(state.pid, state.pid_start)
    assert process_runs(state.supervisor_pid, state.supervisor_start)
    assert os.getsid(state.supervisor_pid or 0) == state.supervisor_pid

    go.touch()
    wait_for_state(log, "exited")

    lines = log_lines(log)
    assert "stdin /dev/null" in lines
    assert "unbuffered 1" in lines
    assert "session leader True" in lines
    assert "finished" in lines
    assert re.fullmatch(r"\[nbresume run\] exit 0 after \d+s", final_marker(log))
    assert read_state(log).exit_code == 0  # type: ignore[union-attr]


def test_a_lost_terminal_stops_neither_the_job_nor_its_supervisor(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # An SSH session that drops closes the terminal: the kernel sends SIGHUP to the
    # terminal's session, and writing to it fails from then on.
    job, go = waiting_job(tmp_path)
    log = tmp_path / "run.log"
    argv = nbresume_argv("run", "--log", str(log), "--", *job)
    pid, terminal = pty.fork()  # a real process: the command runs on a terminal of its own
    if pid == 0:  # the child: a login shell's foreground command, on the terminal
        os.execve(argv[0], argv, child_env)
    seen = b""
    deadline = time.monotonic() + HANG_S
    while b"session leader" not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([terminal], [], [], 0.5)
        if ready:
            try:
                seen += os.read(terminal, 4096)
            except OSError:
                break
    assert b"session leader True" in seen, seen.decode(errors="replace")

    os.close(terminal)  # the connection drops
    go.touch()
    wait_for_state(log, "exited")
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    assert "finished" in log_lines(log)
    assert re.fullmatch(r"\[nbresume run\] exit 0 after \d+s", final_marker(log))


def test_a_killed_job_is_started_again_and_resumes_from_its_checkpoint(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    ckpt = tmp_path / "ckpt"
    runner = start_job(
        nbresume_argv(
            "run", "--retries", "2", "--backoff", "0.2", "--dir", str(ckpt), "--",
            *train_argv(ckpt, 24, "--torch", "--every", "3", "--sleep", "0.05"),
        ),
        child_env,
    )  # fmt: skip
    log = ckpt / "nbresume-run.log"
    wait_until(lambda: "step 8" in log_lines(log), "step 8 in the log")
    state = read_state(log)
    assert state is not None
    assert state.pid is not None
    os.kill(state.pid, signal.SIGKILL)  # a preemption with no warning

    code = runner.finish()

    assert code == 0, runner.output
    starts = [int(line.split()[1]) for line in log_lines(log) if line.startswith("start ")]
    assert len(starts) == 2, runner.output
    assert starts[0] == 0, runner.output
    assert 0 < starts[1] < 24, f"the second attempt did not resume: {runner.output}"
    assert "done" in log_lines(log)
    assert any("killed by SIGKILL" in line and "attempt 2 of 3" in line for line in runner.lines)
    assert final_marker(log).startswith("[nbresume run] exit 0 after ")
    assert read_state(log).attempt == 2  # type: ignore[union-attr]
    assert verified_steps(ckpt)[24] is True


def test_a_python_exception_is_not_retried(tmp_path: Path, child_env: dict[str, str]) -> None:
    log = tmp_path / "run.log"
    done = warmfork.run(
        nbresume_argv(
            "run", "--retries", "3", "--backoff", "0", "--log", str(log), "--",
            sys.executable, "-c", "print('step 1'); raise ValueError('bad shape in layer 3')",
        ),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )  # fmt: skip

    assert done.returncode == 1
    lines = log_lines(log)
    assert sum("attempt " in line for line in lines) == 1, lines
    reason = lines[-2]
    assert "Python exception (ValueError: bad shape in layer 3)" in reason
    assert "not retried" in reason
    assert "fix the code" in reason
    assert final_marker(log) == lines[-1]
    assert lines[-1].startswith("[nbresume run] exit 1 ")
    assert "bad shape in layer 3" in done.stdout  # the terminal saw the same log


DISK_FILLER = """
import sys
import numpy as np
from nbresume.checkpoint.store.store import CheckpointStore
mode, folder = sys.argv[1], sys.argv[2]
big = np.ones(1 << 20, dtype=np.float32)  # 4 MB on a disk of 1 MB
if mode == "nbresume":
    CheckpointStore(folder, check_space=False).save(1, tensors={"model": {"w": big}})
else:
    with open(folder + "-log.bin", "wb") as out:
        out.write(big.tobytes())
"""


@pytest.fixture
def private_tmpfs() -> list[str]:
    """The command prefix that mounts a 1 MB tmpfs at $1 in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    prefix = [
        "unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
        'mount -t tmpfs -o size=1m tmpfs "$1" && shift && exec "$@"', "sh",
    ]  # fmt: skip
    probe = subprocess.run([*prefix, "/mnt", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("writer", ["nbresume", "plain"])
def test_a_full_disk_is_not_retried(
    writer: str, private_tmpfs: list[str], tmp_path: Path, child_env: dict[str, str]
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "filler.py"
    script.write_text(DISK_FILLER)
    log = tmp_path / "run.log"

    # A real process: the command runs inside unshare's private mount namespace.
    done = subprocess.run(
        [
            *private_tmpfs, str(disk),
            *nbresume_argv("run", "--retries", "3", "--backoff", "0", "--log", str(log), "--"),
            sys.executable, str(script), writer, str(disk / "ckpt"),
        ],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )  # fmt: skip

    assert done.returncode == 1, done.stdout + done.stderr
    lines = log_lines(log)
    assert sum("attempt " in line for line in lines) == 1, lines
    assert "StorageFullError" in done.stdout or "No space left on device" in done.stdout
    assert lines[-2].startswith("[nbresume run] ")
    assert "the disk is full" in lines[-2]
    assert "not retried" in lines[-2]
    assert "free space" in lines[-2]
    assert lines[-1].startswith("[nbresume run] exit 1 after ")


def test_a_stop_signal_to_the_supervisor_is_passed_on_and_ends_the_run(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # `kill <supervisor>`, or a container runtime stopping `nbresume run` as its main process:
    # the job saves at its next step boundary and stops, and is not started again.
    ckpt = tmp_path / "ckpt"
    runner = start_job(
        nbresume_argv(
            "run", "--retries", "3", "--backoff", "0", "--dir", str(ckpt), "--",
            *train_argv(ckpt, 10_000, "--every", "1000"),
        ),
        child_env,
    )  # fmt: skip
    runner.wait_for_line("step 5")

    runner.proc.send_signal(signal.SIGTERM)
    code = runner.finish()

    log = ckpt / "nbresume-run.log"
    assert code == 143, runner.output
    assert sum("attempt " in line for line in log_lines(log)) == 1
    assert "stopped on request: the supervisor received SIGTERM" in log_lines(log)[-2]
    saved = verified_steps(ckpt)
    assert saved
    assert all(saved.values())
    assert max(saved) == runner.steps()[-1] + 1  # the step boundary after the last step


def test_math_threads_follow_the_cpu_quota_unless_set(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs of a larger host
    job, go = waiting_job(tmp_path)
    go.touch()
    env = {**child_env, "NBRESUME_CGROUP_ROOT": str(cgroup)}

    for preset, expected in ((None, "1"), ("3", "3")):
        log = tmp_path / f"run-{preset}.log"
        run_env = env if preset is None else {**env, "OMP_NUM_THREADS": preset}
        # A new interpreter: OMP_NUM_THREADS is read as one starts (a warm server of its own
        # would cost more than this one start).
        subprocess.run(
            nbresume_argv("run", "--log", str(log), "--", *job),
            env=run_env,
            capture_output=True,
            timeout=HANG_S,
            check=True,
        )
        assert f"threads {expected}" in log_lines(log)


def test_a_second_run_on_the_same_log_is_refused_while_the_first_is_alive(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    job, go = waiting_job(tmp_path)
    log = tmp_path / "run.log"
    first = warmfork.run(
        nbresume_argv("run", "--detach", "--log", str(log), "--", *job),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert first.returncode == 0, first.stderr

    second = warmfork.run(
        nbresume_argv("run", "--log", str(log), "--", *job),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )

    assert second.returncode == 1
    assert "a run is already going on with this log" in second.stderr
    go.touch()
    wait_for_state(log, "exited")


def test_a_command_that_does_not_exist(tmp_path: Path, child_env: dict[str, str]) -> None:
    log = tmp_path / "run.log"
    done = warmfork.run(
        nbresume_argv("run", "--detach", "--log", str(log), "--", "no-such-trainer", "--x"),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 127
    assert "the job did not start: cannot start the command" in done.stdout
    state = read_state(log)
    assert state is not None
    assert state.pid is None
    assert state.exit_code == 127
