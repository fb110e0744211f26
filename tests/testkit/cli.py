"""nbresume's command line, run in the test's own process."""

from __future__ import annotations

import pytest

from nbresume.cli import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the command in-process: its exit code (argparse's exits become codes too), and
    what it wrote to stdout and stderr since the last read of ``capsys``."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
