"""When to save: every N steps, every duration, or the Young/Daly optimum.

Young/Daly: with checkpoint cost C and mean time between interruptions M, the interval that
loses the least expected work is W = sqrt(2 * M * C). nbresume measures C (the time a save
takes) and the time a step takes, and rounds W down to a whole number of steps.
"""

from __future__ import annotations

import math

from nbresume.checkpoint import hooks
from nbresume.checkpoint.arguments import (
    check_positive_seconds,
    is_int,
    is_number,
    kind,
    refused,
)
from nbresume.checkpoint.units import DURATION, parse_duration

#: Until the first save has been measured, "auto" saves after this many seconds.
AUTO_FIRST_SAVE_S = 120.0


def young_daly_seconds(save_cost_s: float, mtbf_s: float) -> float:
    """The optimal checkpoint interval in seconds, sqrt(2 * MTBF * C)."""
    return math.sqrt(2.0 * mtbf_s * max(save_cost_s, 1e-6))


_EVERY_FIX = (
    'every=500 saves every 500 steps, every="15min" every 15 minutes, every="auto" at the '
    "interval that loses the least work, every=None only at the end, a deadline or a signal"
)


def parse_every(every: object, call: str = "Checkpointer") -> tuple[int | None, float | None, bool]:
    """``every=`` as (steps, seconds, auto); raises ArgumentError naming the value."""
    if every is None:
        return None, None, False
    if isinstance(every, bool):
        raise refused(call, "every", every, "a bool is not a cadence", _EVERY_FIX)
    if is_int(every):
        if int(every) < 1:
            raise refused(
                call,
                "every",
                every,
                "a cadence is at least 1 step",
                "every=None saves only at the end, at a deadline or on a signal; every=1 "
                "saves after every step",
            )
        return int(every), None, False
    if is_number(every):
        seconds = float(every)
        return None, check_positive_seconds(call, "every", every, seconds, _EVERY_FIX), False
    if every == "auto":
        return None, None, True
    if not isinstance(every, str):
        raise refused(call, "every", every, f"{kind(every)} is not a cadence", _EVERY_FIX)
    unitless = DURATION.fullmatch(every)
    if unitless is not None and unitless.group(2) is None:
        raise refused(
            call,
            "every",
            every,
            "a number without a unit could mean steps or seconds",
            f'every={every.strip()} for steps, every="{every.strip()}s" for seconds',
        )
    try:
        seconds = parse_duration(every)
    except ValueError as exc:
        raise refused(call, "every", every, str(exc), _EVERY_FIX) from None
    return None, check_positive_seconds(call, "every", every, seconds, _EVERY_FIX), False


class Cadence:
    """Decides at each step boundary whether a save is due.

    ``every`` is an int (steps), a duration string, a number of seconds as a float, ``"auto"``
    or ``None`` (never on cadence; saves still happen at the end, on signals and deadlines).
    Anything else raises :class:`~nbresume.errors.ArgumentError`.
    """

    def __init__(self, every: int | float | str | None, *, mtbf_s: float = 6 * 3600.0) -> None:
        self.steps, self.seconds, self.auto = parse_every(every)
        self.mtbf_s = mtbf_s
        self.save_cost_s: float | None = None
        self.step_time_s: float | None = None

    def observe_save(self, seconds: float) -> None:
        self.save_cost_s = (
            seconds if self.save_cost_s is None else 0.5 * (self.save_cost_s + seconds)
        )

    def observe_step(self, seconds: float) -> None:
        alpha = 0.1
        self.step_time_s = (
            seconds
            if self.step_time_s is None
            else ((1 - alpha) * self.step_time_s + alpha * seconds)
        )

    def interval_steps(self) -> int | None:
        """The current "auto" interval in steps (``None`` until it can be computed)."""
        if not self.auto or self.save_cost_s is None or not self.step_time_s:
            return None
        seconds = young_daly_seconds(self.save_cost_s, self.mtbf_s)
        return max(1, math.floor(seconds / self.step_time_s))

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a save is due ``steps_since`` steps and ``seconds_since`` seconds after the
        last one."""
        forced = hooks.steering().save_every  # `nbresume check`: kills must find saves to hit
        if forced is not None:
            return steps_since >= forced
        if self.steps is not None:
            return steps_since >= self.steps
        if self.seconds is not None:
            return seconds_since >= self.seconds
        if self.auto:
            interval = self.interval_steps()
            if interval is None:
                return seconds_since >= AUTO_FIRST_SAVE_S
            return steps_since >= interval
        return False
