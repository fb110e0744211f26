"""Checks of the arguments of the public API.

Every check runs when the argument is given, before anything is created or changed on disk,
and a refusal is an :class:`~nbresume.errors.ArgumentError` that names the call, the argument
and the value, and says what to pass instead.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from nbresume.errors import ArgumentError

_SHORT = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 4


def show(value: object) -> str:
    """A short repr of ``value`` for an error message (a model's repr has hundreds of lines)."""
    text = _SHORT.repr(value)
    return text if "\n" not in text else f"<{type(value).__name__} object>"


def refused(call: str, argument: str, value: object, problem: str, fix: str) -> ArgumentError:
    """The error for ``call(argument=value)``: ``problem`` says what is wrong, ``fix`` what
    to pass instead."""
    where = f"{call}({argument}={show(value)})"
    return ArgumentError(f"{where}: {problem}", where=where, fix=fix)


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """An integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[numbers.Real]:
    """A real number (int, float, NumPy scalar), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def kind(value: object) -> str:
    """``"a bool"``, ``"a str"``, ``"a float"``: what a value is, for a message."""
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def check_bool(call: str, argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise refused(
            call,
            argument,
            value,
            f"{kind(value)} is not True or False",
            f"{argument}=True or {argument}=False",
        )
    return value


def check_int(call: str, argument: str, value: object, *, minimum: int, fix: str) -> int:
    """An integer of at least ``minimum`` (a bool, a float or a str is refused)."""
    if not is_int(value):
        raise refused(call, argument, value, f"{kind(value)} is not a whole number", fix)
    number = int(value)
    if number < minimum:
        raise refused(call, argument, value, f"it must be at least {minimum}", fix)
    return number


def check_keep(call: str, value: object) -> int | None:
    """``keep=``: how many of the newest checkpoints to keep, at least 1, or ``None`` (all)."""
    if value is None:
        return None
    fix = "keep=3 keeps the 3 newest checkpoints; keep=None keeps every checkpoint"
    if not is_int(value):
        raise refused(call, "keep", value, f"{kind(value)} is not a number of checkpoints", fix)
    keep = int(value)
    if keep < 1:
        raise refused(call, "keep", value, "keep must be at least 1 (or None to keep all)", fix)
    return keep


def check_keep_best(call: str, value: object) -> tuple[str, str, int] | None:
    """``keep_best=(metric, "min" | "max"[, count])``; the count is 0 where not given (then
    ``keep`` applies)."""
    if value is None:
        return None
    fix = 'keep_best=("val_loss", "min") or keep_best=("acc", "max", 2)'
    if isinstance(value, str):
        fix = f'keep_best=("{value}", "min") or keep_best=("{value}", "max")'
        raise refused(call, "keep_best", value, "it needs the metric and min or max", fix)
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        raise refused(
            call,
            "keep_best",
            value,
            "it must be (metric, mode) or (metric, mode, count)",
            fix,
        )
    metric, mode = value[0], value[1]
    count = value[2] if len(value) == 3 else None
    if not isinstance(metric, str) or not metric:
        raise refused(call, "keep_best", value, "the metric must be a name (a str)", fix)
    if mode not in ("min", "max"):
        raise refused(
            call,
            "keep_best",
            value,
            f"the mode must be 'min' or 'max', got {show(mode)}",
            f'keep_best=("{metric}", "min") keeps the lowest, ("{metric}", "max") the highest',
        )
    if count is None:
        return metric, mode, 0
    if not is_int(count) or int(count) < 1:
        raise refused(
            call,
            "keep_best",
            value,
            f"the count must be a positive integer, got {show(count)}",
            f'keep_best=("{metric}", "{mode}", 2) keeps the 2 best; leave the count out to '
            "keep as many as keep=",
        )
    return metric, mode, int(count)


def check_storage_options(call: str, value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise refused(
            call,
            "storage_options",
            value,
            "it must be a dict of the file system's options",
            'storage_options={"endpoint_url": "http://127.0.0.1:9000"}, or leave it out',
        )
    return value


def check_callbacks(call: str, value: object) -> list[Callable[..., Any]] | None:
    if value is None:
        return None
    if callable(value):
        raise refused(
            call, "callbacks", value, "it must be a list of callables", "callbacks=[function]"
        )
    if not isinstance(value, (list, tuple)):
        raise refused(
            call,
            "callbacks",
            value,
            f"{kind(value)} is not a list of callables",
            "callbacks=[function, ...], each called with every Event",
        )
    for item in value:
        if not callable(item):
            raise refused(
                call,
                "callbacks",
                value,
                f"{show(item)} cannot be called",
                "callbacks=[function, ...], each called with every Event",
            )
    return list(value)


def check_metric(call: str, value: object, default_name: str) -> dict[str, float]:
    """``metric=``: a number, or a mapping of names to numbers, as ``{name: float}``.

    A NaN or an infinity is a number too (a diverged loss): it is not recorded, with a
    warning, rather than losing the checkpoint (see ``pending._finite_metrics``).
    """
    if value is None:
        return {}
    fix = 'metric=0.25 (named by keep_best), or metric={"val_loss": 0.25, "acc": 0.91}'
    if isinstance(value, Mapping):
        out: dict[str, float] = {}
        for name, number in value.items():
            if not isinstance(name, str) or not name:
                raise refused(call, "metric", value, f"the name {show(name)} is not a str", fix)
            out[name] = _metric_number(call, value, number, fix)
        return out
    return {default_name: _metric_number(call, value, value, fix)}


def _metric_number(call: str, metric: object, value: object, fix: str) -> float:
    # A 0-d tensor (a loss) converts with float(); a str or a bool is never taken for a number.
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise refused(call, "metric", metric, f"{show(value)} is not a number", fix)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor of several numbers
        raise refused(call, "metric", metric, f"{show(value)} is not one number", fix) from None


def check_positive_seconds(
    call: str, argument: str, value: object, seconds: float, fix: str
) -> float:
    """A duration in seconds that is finite and more than 0."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise refused(call, argument, value, "it must be a time of more than 0 seconds", fix)
    return seconds
