"""Telling torch's gloo teardown crash apart from a real failure, for every DDP test.

torch (2.13 at least) with gloo sometimes aborts a rank inside ``destroy_process_group()`` or
at exit: libstdc++ prints "terminate called without an active exception" (a thread still
joinable when destroyed) and raises SIGABRT, exit status -6 (134 through a shell). It happens
in a plain two-rank script without nbresume, in about one run of a dozen on a loaded machine,
after the training is over.

So every worker reports its results first, then prints :data:`TEARDOWN` just before
``destroy_process_group()``, and a rank counts as ended well when it exited 0, or when it was
the teardown crash exactly: :data:`TEARDOWN` was the last thing it printed, it died of SIGABRT,
and its stderr holds :data:`ABORT_MESSAGE`. Anything else fails: another signal, another
message, a crash before the marker, a marker followed by more output. Under ``torchrun`` a
rank that had reached its teardown and was then stopped by torchrun itself (SIGTERM, because
another rank died of that crash) counts as ended well too.

Each accepted crash is reported as a warning, so the test summary shows how often it happens.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

#: What a worker prints (after its rank prefix) once every result is reported, just before
#: ``dist.destroy_process_group()``.
TEARDOWN = "teardown"
#: What libstdc++ writes to stderr before it aborts the process in the teardown crash.
ABORT_MESSAGE = "terminate called without an active exception"


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a job ended."""

    rank: int
    #: Exit status; negative: killed by that signal.
    code: int
    #: What the rank printed on stdout, line by line, without its rank prefix.
    said: tuple[str, ...]
    #: What the rank wrote on stderr.
    stderr: str
    #: Whether the launcher (torchrun) itself sent it SIGTERM, stopping the job.
    stopped_by_launcher: bool = False


def teardown_abort(end: RankEnd) -> bool:
    """Whether ``end`` is the upstream teardown crash, and nothing else."""
    return (
        end.code == -signal.SIGABRT and end.said[-1:] == (TEARDOWN,) and ABORT_MESSAGE in end.stderr
    )


def problems(ends: Sequence[RankEnd]) -> list[str]:
    """Why the ranks did not all end well (empty when they did); warns about each teardown
    crash that was let through."""
    aborted = [end for end in ends if teardown_abort(end)]
    found = []
    for end in ends:
        if end.code == 0:
            continue
        if end in aborted:
            warnings.warn(
                f"rank {end.rank} died of torch's gloo teardown abort after reporting its "
                "results (accepted: an upstream crash)",
                stacklevel=2,
            )
            continue
        stopped_after_teardown = (
            end.code == -signal.SIGTERM
            and end.stopped_by_launcher
            and end.said[-1:] == (TEARDOWN,)
            and bool(aborted)
        )
        if stopped_after_teardown:
            continue
        last = end.said[-1] if end.said else "(nothing)"
        tail = " | ".join(end.stderr.strip().splitlines()[-5:])
        found.append(f"rank {end.rank} exit {end.code}, its last line {last!r}, stderr: {tail}")
    return found
