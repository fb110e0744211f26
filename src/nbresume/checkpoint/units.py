"""Sizes and durations in the units people read: one formatter of each for messages, the CLI,
the panel and the status line."""

from __future__ import annotations


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
