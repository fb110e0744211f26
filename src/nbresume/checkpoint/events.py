"""Progress events: how the core tells a panel, a progress bar or a logger what it does.

The core calls plain callables with an :class:`Event`; it imports no UI library. A callback
that raises is logged and dropped from nothing else: training never fails because a display
did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("nbresume")

#: Event kinds, in the order a save emits them.
STEP = "step"
SAVE_STARTED = "save_started"
COMMITTED = "committed"
VERIFIED = "verified"
#: On a write-back store (Google Drive's mount): verified locally, not yet confirmed by the
#: durable store (data: ``state`` syncing / missing / failed, ``reason``). Not saved yet.
SYNCING = "syncing"
#: The durable store itself confirmed every file of the checkpoint: now it is saved.
DURABLE = "durable"
FAILED = "failed"
STOPPING = "stopping"
DONE = "done"
#: A restore continued a checkpoint saved by a job of another number of processes (data:
#: ``before``, ``after``, ``text``); said once, at the restore.
RESHAPED = "world_size_changed"


@dataclass(frozen=True)
class Event:
    """Something the checkpointer did. ``data`` holds kind-specific details (size, location,
    error, total, reason...)."""

    kind: str
    step: int
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


Callback = Callable[[Event], None]


class EventBus:
    """Delivers events to subscribers; safe to call from the background writer thread."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.callbacks: list[Callback] = list(callbacks or [])

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        """Add ``callback``; return a function that removes it."""
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback) if callback in self.callbacks else None

    def emit(self, kind: str, step: int, **data: Any) -> None:
        if not self.callbacks:
            return
        event = Event(kind, step, data)
        for callback in list(self.callbacks):
            try:
                callback(event)
            except Exception:
                log.exception("nbresume: a progress callback failed on %s", kind)


#: Called with every Checkpointer when it is created; see :func:`watch_checkpointers`.
_watchers: list[Callable[[Any], None]] = []


def watch_checkpointers(callback: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``callback(checkpointer)`` for each Checkpointer created from now on, so that a
    notebook panel or a terminal status line can subscribe to its events without the core
    knowing about either. Returns a function that stops watching."""
    _watchers.append(callback)
    return lambda: _watchers.remove(callback) if callback in _watchers else None


#: Shows a Checkpointer's progress when no watcher does (a plain script without
#: ``nbresume.init``); registered from above by :func:`provide_default_watcher`.
_default_watcher: Callable[[Any], None] | None = None


def provide_default_watcher(callback: Callable[[Any], None] | None) -> None:
    """Register what follows a new Checkpointer that nothing watches (``None``: nothing)."""
    global _default_watcher  # noqa: PLW0603 -- this module is the registry
    _default_watcher = callback


def announce(checkpointer: Any) -> None:
    """Tell the watchers about a new Checkpointer; a watcher that raises is logged.

    A Checkpointer made with ``quiet=True`` is announced to nobody. When nothing watches, the
    default watcher (a status line on stderr) follows it.
    """
    if getattr(checkpointer, "quiet", False):
        return
    default = [_default_watcher] if not _watchers and _default_watcher is not None else []
    for callback in list(_watchers) or default:
        try:
            callback(checkpointer)
        except Exception:
            log.exception("nbresume: a checkpointer watcher failed")
