"""The training loop's side of the core: the Checkpointer, when to save, when to stop.

The top layer: :mod:`.checkpointer` (:class:`Checkpointer`), :mod:`.epochloop` (the loop of
``epochs()``), :mod:`.strategies` (one process, data parallel, sharded), :mod:`.saver` (writing
a snapshot now or in the background, and reporting the save), :mod:`.cadence` (when to save),
:mod:`.control` (when a loop saves and stops, whoever runs it: :class:`LoopControl`),
:mod:`.stops` and :mod:`.deadline` (the signals and the deadline), :mod:`.durability`
(saved where it counts, and ``wait(durable=True)``) and :mod:`.keywords` (the constructor's
arguments, checked first).

This package is the layer's API: the names below are what the rest of the package imports.
"""

from __future__ import annotations

from nbresume.checkpoint.loop.cadence import Cadence
from nbresume.checkpoint.loop.checkpointer import Checkpointer
from nbresume.checkpoint.loop.control import (
    BoundaryFlags,
    ControlledLoop,
    LoopControl,
    RunningLoop,
)
from nbresume.checkpoint.loop.deadline import check_deadline, resolve_deadline, session_started_at
from nbresume.checkpoint.loop.durability import Confirmation, DurabilityWatcher, confirm
from nbresume.checkpoint.loop.saver import SaveFunction, report_save
from nbresume.checkpoint.loop.stops import deadline_margin, deadline_reason, signal_reason
from nbresume.checkpoint.loop.stops import install as install_stop_handler
from nbresume.checkpoint.loop.stops import restore as restore_signal_handlers

__all__ = [
    "BoundaryFlags",
    "Cadence",
    "Checkpointer",
    "Confirmation",
    "ControlledLoop",
    "DurabilityWatcher",
    "LoopControl",
    "RunningLoop",
    "SaveFunction",
    "check_deadline",
    "confirm",
    "deadline_margin",
    "deadline_reason",
    "install_stop_handler",
    "report_save",
    "resolve_deadline",
    "restore_signal_handlers",
    "session_started_at",
    "signal_reason",
]
