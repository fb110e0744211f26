"""Reporting one save: its events, its cost learnt, its durability followed.

The Checkpointer's saves (:class:`~nbresume.checkpoint.snapshot.Saver`) and a framework's
(:class:`~nbresume.frameworks.watch.Watch`) report the same way, through :func:`commit`:
``save_started``, ``committed``, ``verified`` (or ``failed``, and the error is raised); the
cadence learns the save's cost, and on a write-back store (Google Drive's mount) the
checkpoint is followed as ``syncing`` until the durable store confirms it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nbresume.checkpoint import events as ev
from nbresume.checkpoint.cadence import Cadence
from nbresume.checkpoint.info import CheckpointInfo

#: What one save runs: given the callback of the commit, it commits and returns the verified
#: checkpoint (``pending.commit(on_committed=...)``, ``store.save(..., on_committed=...)``).
SaveFunction = Callable[[Callable[[CheckpointInfo], None]], CheckpointInfo]


def commit(
    events: ev.EventBus,
    cadence: Cadence,
    step: int,
    save: SaveFunction,
    *,
    started: float | None = None,
    track: Callable[[CheckpointInfo], None] | None = None,
    report: bool = True,
) -> CheckpointInfo:
    """Run ``save`` and return its checkpoint. ``committed`` is always emitted; with
    ``report`` also ``save_started`` (unless ``started``, the :func:`time.monotonic` time the
    save began, says it was), ``verified`` or ``failed``, the cost taught to ``cadence``, and
    the checkpoint handed to ``track`` (the durability watcher's ``syncing``)."""
    if started is None:
        started = time.monotonic()
        if report:
            events.emit(ev.SAVE_STARTED, step)
    try:
        info = save(lambda i: events.emit(ev.COMMITTED, i.step, location=i.location, size=i.size))
    except BaseException as exc:
        if report:
            events.emit(ev.FAILED, step, error=str(exc))
        raise
    if report:
        seconds = time.monotonic() - started
        cadence.observe_save(seconds)
        events.emit(ev.VERIFIED, info.step, location=info.location, size=info.size, seconds=seconds)
        if track is not None:
            track(info)
    return info


__all__ = ["SaveFunction", "commit"]
