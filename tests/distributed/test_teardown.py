"""The recogniser of torch's gloo teardown crash lets that crash through and nothing else.

Each case is a real process that reports a result, then ends in some way; only "printed the
teardown marker last, wrote libstdc++'s message, died of SIGABRT" (or a clean exit) passes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .teardown import ABORT_MESSAGE, TEARDOWN, RankEnd, problems

MESSAGE = f"sys.stderr.write({ABORT_MESSAGE + chr(10)!r}); sys.stderr.flush()"
MARKER = f"say({TEARDOWN!r})"


def rank_end(tmp_path: Path, body: str, *, rank: int = 0, stopped: bool = False) -> RankEnd:
    """Run ``body`` as a rank would (``say`` prints a line of this rank); how it ended."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        def say(text):
            sys.stdout.write("rank {rank} " + text + "\\n"); sys.stdout.flush()
        say("final 0123abcd")
        """
    ) + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    prefix = f"rank {rank} "
    said = tuple(line[len(prefix) :] for line in proc.stdout.splitlines())
    return RankEnd(rank, proc.returncode, said, proc.stderr, stopped)


@pytest.mark.parametrize(
    ("body", "accepted"),
    [
        ("", True),  # a clean exit
        (f"{MARKER}\n{MESSAGE}\nos.abort()", True),  # the teardown crash
        (f"{MARKER}\nsys.stderr.write('free(): invalid pointer\\n')\nos.abort()", False),
        (f"{MESSAGE}\nos.abort()\n{MARKER}", False),  # before the marker
        (f"{MARKER}\n{MESSAGE}\nos.kill(os.getpid(), signal.SIGSEGV)", False),
        (f"{MARKER}\n{MESSAGE}\nsys.exit(1)", False),
        (f"{MARKER}\nsay('step 21')\n{MESSAGE}\nos.abort()", False),  # more after the marker
    ],
    ids=[
        "clean-exit",
        "teardown-abort",
        "another-message",
        "abort-before-the-marker",
        "another-signal",
        "exit-status-1",
        "output-after-the-marker",
    ],
)
def test_only_the_teardown_abort_is_let_through(body: str, accepted: bool, tmp_path: Path) -> None:
    end = rank_end(tmp_path, body)
    if accepted and end.code:
        with pytest.warns(UserWarning, match="teardown abort"):
            assert problems([end]) == []
    elif accepted:
        assert problems([end]) == []
    else:
        [problem] = problems([end])
        assert problem.startswith(f"rank 0 exit {end.code}")


def test_a_rank_torchrun_stopped_after_its_teardown_passes_only_beside_the_abort(
    tmp_path: Path,
) -> None:
    aborted = rank_end(tmp_path, f"{MARKER}\n{MESSAGE}\nos.abort()", rank=1)
    stopped = rank_end(
        tmp_path, f"{MARKER}\nos.kill(os.getpid(), signal.SIGTERM)", rank=0, stopped=True
    )
    assert stopped.code == -signal.SIGTERM
    with pytest.warns(UserWarning, match="rank 1 died of torch's gloo teardown abort"):
        assert problems([stopped, aborted]) == []
    # Without the abort beside it, or without the marker, a SIGTERM is a failure.
    assert len(problems([stopped])) == 1
    early = rank_end(tmp_path, "os.kill(os.getpid(), signal.SIGTERM)", rank=0, stopped=True)
    with pytest.warns(UserWarning, match="rank 1 died"):
        assert len(problems([early, aborted])) == 1
