"""Stopping cleanly: the signals that ask a loop to save and stop, and the deadline's margin.

Shared by the :class:`~nbresume.checkpoint.loop.Checkpointer` and by the watch that
framework integrations use (:mod:`nbresume.frameworks.watch`), so that both stop for the same
signals and leave the same time before a deadline.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from nbresume.checkpoint.loop.cadence import Cadence

#: The signals that ask a running loop to save at the next step boundary and stop.
STOP_SIGNALS: list[signal.Signals] = [signal.SIGTERM, signal.SIGINT] + (
    [signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []
)

Handler = Callable[[int, FrameType | None], None]


def install(handler: Handler) -> dict[int, Any]:
    """Route every stop signal to ``handler``; return the handlers it replaced (for
    :func:`restore`). Only the main thread may do this; elsewhere nothing is installed."""
    previous: dict[int, Any] = {}
    for signum in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            previous[signum] = signal.signal(signum, handler)
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install` replaced."""
    for number, handler in previous.items():
        with contextlib.suppress(ValueError, OSError):
            signal.signal(number, handler)


def deadline_margin(cadence: Cadence, *, explicit: bool) -> float:
    """Enough time for one more step and a save, measured; a floor on platform caps (an
    ``explicit`` deadline, one the user gave, has none)."""
    save = cadence.save_cost_s if cadence.save_cost_s is not None else 1.0
    step = cadence.step_time_s or 0.0
    floor = 0.0 if explicit else 120.0
    return floor + 3.0 * save + 2.0 * step


def deadline_reason(deadline: float | None, source: str, margin: float) -> str:
    """Why to stop now for the deadline (``""`` while there is time left)."""
    if deadline is not None and time.time() + margin >= deadline:
        return f"stopping before the session deadline ({source})"
    return ""


def signal_reason(signum: int) -> str:
    """The stop reason of a received signal."""
    return f"received {signal.Signals(signum).name}"
