"""Jobs of several ranks forked from one warm process, so that a test can run many short
distributed jobs without paying torch's import for each rank.

Both sides of it live here:

- in a worker script (``sharded_worker.py``, ``legs_worker.py``), :func:`serve` reads one
  command a line from stdin, forks the ranks of a fresh job for it (each with a free port for
  its process group), waits for all of them, prints each rank's stderr as ``rankN stderr ...``
  lines, then ``exit RANK CODE`` per rank and ``done``;
- in a test, :class:`RankServer` starts such a script and returns the lines of each job.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

#: How long one job may take before the test gives up on it.
RUN_TIMEOUT_S = 180
#: How many times a job whose port was taken before it listened is started.
PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(
    run_rank: Callable[[int, int, int, list[str]], int], world: Callable[[list[str]], int]
) -> None:
    """The worker's loop: for each command line, fork ``world(argv)`` ranks that each run
    ``run_rank(rank, world, port, argv)`` and exit with what it returns."""
    for line in sys.stdin:
        argv = line.split()
        if not argv:
            continue
        codes, errors = run_job(run_rank, world(argv), argv)
        for rank in sorted(codes):
            with open(os.path.join(errors, str(rank)), errors="replace") as written:
                for text in written:
                    print(f"rank{rank} stderr {text.rstrip()}", flush=True)
            print("exit", rank, codes[rank], flush=True)
        shutil.rmtree(errors, ignore_errors=True)
        print("done", flush=True)


def run_job(
    run_rank: Callable[[int, int, int, list[str]], int], size: int, argv: list[str]
) -> tuple[dict[int, int], str]:
    """Fork the ``size`` ranks of one job, each running ``run_rank(rank, size, port, argv)``
    with a free port for its process group, and wait for them: their exit codes by rank, and
    the folder of their stderr files (one a rank, named by it; the caller removes it)."""
    # The port is free when drawn, not when rank 0 listens on it: another process of the
    # machine can take it in between, and the job then fails in its first call, before any
    # rank has done anything. Such a job is started again, on another port.
    for _ in range(PORT_ATTEMPTS):
        codes, errors = _job(run_rank, size, free_port(), argv)
        if not (any(codes.values()) and _port_was_taken(errors)):
            break
        shutil.rmtree(errors, ignore_errors=True)
    return codes, errors


def _job(
    run_rank: Callable[[int, int, int, list[str]], int], size: int, port: int, argv: list[str]
) -> tuple[dict[int, int], str]:
    """Fork the ``size`` ranks of one job and wait for them: their exit codes, and the folder
    of their stderr files (one a rank)."""
    sys.stdout.flush()
    errors = tempfile.mkdtemp(prefix="ranks-stderr-")
    children = {}
    for rank in range(size):
        pid = os.fork()
        if pid == 0:
            # The rank's stderr in a file of its own (C++ code writes to fd 2 directly),
            # printed with the rank's name once it is gone.
            stderr = os.open(
                os.path.join(errors, str(rank)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
            )
            os.dup2(stderr, 2)
            os.close(stderr)
            # Python's own writes there too where sys.stderr is not fd 2 (pytest's capture).
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            code = 1
            try:
                code = run_rank(rank, size, port, argv)
            except SystemExit as stop:  # a stop on a signal: 128 + the signal's number
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                traceback.print_exc()  # before os._exit, which would lose it
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    codes = {}
    while children:
        pid, status = os.wait()
        codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    return codes, errors


def _port_was_taken(errors: str) -> bool:
    """Whether a rank's stderr says its process group's port was in use."""
    for name in os.listdir(errors):
        with open(os.path.join(errors, name), errors="replace") as written:
            text = written.read()
        if "EADDRINUSE" in text or "ddress already in use" in text:
            return True
    return False


class RankServer:
    """A worker script as a test's server of jobs: each :meth:`run` forks the ranks of one
    fresh job and returns their lines. ``tmp``, where given, is the ranks' ``TMPDIR``."""

    def __init__(self, worker: Path, tmp: Path | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if tmp is not None:
            env["TMPDIR"] = str(tmp)
        self.proc = subprocess.Popen(
            [sys.executable, str(worker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("<eof>")

    def run(self, *args: object) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(str(a) for a in args) + "\n")
        self.proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line in ("done", "<eof>"):
                return out
            out.append(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
