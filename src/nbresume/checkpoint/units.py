"""Sizes and durations in the units people read: one formatter of each for messages, the CLI,
the panel and the status line, and the one parser of durations people write (``"15min"``)."""

from __future__ import annotations

import re


def format_bytes(count: int | None) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, as disk tools and quotas show them)."""
    if count is None:
        return "unknown"
    value = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float, *, compact: bool = False) -> str:
    """``5400`` -> ``"1 h 30 min"``, ``90`` -> ``"1 min 30 s"``, ``12`` -> ``"12 s"``.

    ``compact``: ``3725`` -> ``"1h02m"``, ``185`` -> ``"3m05s"``, ``12`` -> ``"12s"``, the fixed
    shape of ``nbresume run``'s last line, which scripts match.
    """
    hours, rest = divmod(max(0, round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    if compact:
        if hours:
            return f"{hours}h{minutes:02d}m"
        return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    if minutes:
        return f"{minutes} min {secs} s" if secs and minutes < 10 else f"{minutes} min"
    return f"{secs} s"


#: A duration people write: a number, then a unit or none (seconds).
DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|sec|secs|m|min|mins|h|hr|hrs|d)?\s*", re.I)
_UNIT_SECONDS = {
    None: 1.0, "ms": 0.001, "s": 1.0, "sec": 1.0, "secs": 1.0, "m": 60.0, "min": 60.0,
    "mins": 60.0, "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "d": 86400.0,
}  # fmt: skip


def parse_duration(text: str) -> float:
    """``"15min"`` -> 900.0; ``"2h"``, ``"90s"``, ``"1.5h"`` likewise. Raises ValueError."""
    match = DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration such as '90s', '15min' or '2h'")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2) and match.group(2).lower()]
