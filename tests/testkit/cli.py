"""nbresume's command line, run in the test's own process or in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import pytest

from nbresume.cli import main
from testkit import warmfork


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the command in-process: its exit code (argparse's exits become codes too), and
    what it wrote to stdout and stderr since the last read of ``capsys``."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def nbresume_argv(*args: str) -> list[str]:
    """The command line of ``nbresume ARGS`` run from this interpreter (what the installed
    console script runs)."""
    return [sys.executable, "-m", "nbresume.cli", *args]


def run_command(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``nbresume ARGS`` in a process of its own: its exit status, stdout and stderr as text.

    The process is forked from the warm server (:mod:`testkit.warmfork`): what such a test
    checks (the exit status, the streams, what the command does to files and processes) needs
    a process, not a fresh interpreter. Tests of the installed console script itself, of
    import time or of what ``import nbresume`` loads keep ``subprocess``."""
    return warmfork.run(
        nbresume_argv(*args), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
