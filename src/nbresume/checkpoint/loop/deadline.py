"""The session clock: when the platform will end this session, measured from its real start.

Platforms with a hard cap (Kaggle: 9 h with a GPU, 12 h without; Colab: up to 12 h) end the
session without a signal; a Slurm job ends at its time limit. ``deadline="auto"`` stops
training cleanly before that, with a margin sized from the measured cost of a save, so that
the last checkpoint is complete and a Kaggle commit ends without an error. The caps are the
platforms' (:mod:`nbresume.platforms`), handed in as a value through
:mod:`nbresume.checkpoint.hooks`: the core never asks the platform itself.
NBRESUME_SESSION_START and NBRESUME_SESSION_CAP override the start and the cap (see
:mod:`nbresume.knobs`).
"""

from __future__ import annotations

import os
import time

from nbresume import knobs
from nbresume.checkpoint import hooks, procfs
from nbresume.checkpoint.arguments import check_positive_seconds, is_number, kind, refused
from nbresume.checkpoint.units import parse_duration

HOUR = 3600.0


def session_started_at() -> float:
    """When this machine's session began (the start of process 1 of this container), as a
    Unix time; NBRESUME_SESSION_START when set; the current process's start when neither can
    be read."""

    forced = knobs.session_start()
    if forced is not None:
        return forced
    try:
        uptime, started = procfs.uptime(), procfs.start_ticks(1)
        if uptime is not None and started is not None:
            age = uptime - started / os.sysconf("SC_CLK_TCK")
            if 0 <= age < 30 * 24 * HOUR:
                return time.time() - age
    except (OSError, ValueError):
        pass  # no clock-tick rate
    return _PROCESS_STARTED


_PROCESS_STARTED = time.time()


def session_deadline() -> tuple[float | None, str]:
    """When the platform ends this session (a Unix time) and what that limit is called, as the
    platform layer provides it (:mod:`nbresume.checkpoint.hooks`); no provider: no cap."""

    return hooks.session_deadline()


_DEADLINE_FIX = (
    'deadline="auto" stops before the platform\'s session cap, deadline=3600 or '
    'deadline="8.5h" that long from now, deadline=None never'
)


def check_deadline(deadline: object, call: str = "Checkpointer") -> float | str | None:
    """``deadline=`` checked: ``None``, ``"auto"``, or the seconds from now (more than 0)."""

    if deadline is None:
        return None
    if deadline == "auto":
        return "auto"
    if is_number(deadline):
        return check_positive_seconds(call, "deadline", deadline, float(deadline), _DEADLINE_FIX)
    if not isinstance(deadline, str):
        problem = f"{kind(deadline)} is not a deadline"
        raise refused(call, "deadline", deadline, problem, _DEADLINE_FIX)
    try:
        seconds = parse_duration(deadline)
    except ValueError as exc:
        raise refused(call, "deadline", deadline, str(exc), _DEADLINE_FIX) from None
    return check_positive_seconds(call, "deadline", deadline, seconds, _DEADLINE_FIX)


def resolve_deadline(deadline: float | int | str | None) -> tuple[float | None, str]:
    """An absolute Unix time to stop by, and where it comes from.

    ``None``: no deadline. A number: that many seconds from now. A duration string
    (``"8h30min"`` is not supported; ``"8.5h"`` is): likewise. ``"auto"``: the platform cap,
    counted from the session's real start. Anything else raises
    :class:`~nbresume.errors.ArgumentError`.
    """
    seconds = check_deadline(deadline)
    if seconds is None:
        return None, ""
    if seconds == "auto":
        return session_deadline()
    unit = "" if isinstance(deadline, str) else "s"
    return time.time() + float(seconds), f"deadline={deadline}{unit}"
