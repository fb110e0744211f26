"""A child process whose stderr is a real pseudo-terminal, and what it drew there."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from collections.abc import Mapping, Sequence


def stderr_on_a_terminal(
    argv: Sequence[str], env: Mapping[str, str], timeout: float = 120
) -> tuple[int, bytes]:
    """Run ``argv`` with stderr on a new pseudo-terminal (stdin and stdout on ``/dev/null``)
    and return its exit code and all it wrote to the terminal."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
        env=dict(env),
    )
    os.close(terminal)
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the other end closed: the process is gone
                break
            if not chunk:
                break
            output += chunk
        elif proc.poll() is not None:
            break
    os.close(controller)
    return proc.wait(timeout=60), output
