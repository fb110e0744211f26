"""The panel's information outside a notebook: one live line in a terminal, log lines otherwise.

On a terminal (the stream is a TTY) the line is redrawn in place with a carriage return, at most
a few times a second, and ends with a newline when the loop stops or finishes. When the output
goes to a file or a pipe (a Slurm log, ``nohup``), carriage returns would pile up, so it writes
plain timestamped lines instead: every checkpoint event at once, progress every ``interval``
seconds. It writes to stderr by default, as progress bars do, so that stdout stays the
program's own. Both say what a crash would lose (the steps and time since the last verified
checkpoint), and the live line carries the warning when that is more than twice the cadence.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, TextIO

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import forksafe
from nbresume.checkpoint.state import MIN_BATCHES, DataWaitShare, data_wait_of
from nbresume.checkpoint.units import format_bytes
from nbresume.notebook.progress import (
    FAILED,
    SAVED,
    WARNING,
    Snapshot,
    Throttle,
    Tracker,
    describe,
)
from nbresume.run import current_run

#: Seconds between two progress lines when the output is not a terminal.
LOG_INTERVAL_S = 60.0
#: Seconds between two redraws of the live line.
TTY_INTERVAL_S = 0.25

_CHECKPOINT_EVENTS = (ev.VERIFIED, ev.SYNCING, ev.DURABLE, ev.FAILED)


class StatusLine:
    """Shows a :class:`~nbresume.notebook.progress.Tracker`'s run on a text stream."""

    def __init__(
        self,
        tracker: Tracker,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        interval: float | None = None,
    ) -> None:
        self.tracker = tracker
        self._stream = stream
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if isatty is not None else False
        self.tty = tty
        if interval is None:
            interval = TTY_INTERVAL_S if tty else LOG_INTERVAL_S
        self._lock = forksafe.lock()
        self._width = 0  # length of the live line now on screen
        self._throttle = Throttle(interval, self._progress)
        self._said: dict[int, str] = {}  # what was last logged of each step's state
        self._input_bound_said = False  # the advice for an input-bound run is given once

    @property
    def stream(self) -> TextIO:
        """Where it writes: the given stream, else whatever sys.stderr is now."""
        return self._stream if self._stream is not None else sys.stderr

    def notify(self, event: ev.Event | None) -> None:
        if event is None or event.kind == "message":
            return
        kind = event.kind
        if kind in (WARNING, ev.RESHAPED):
            if self.tty:  # the logged warning then starts on a line of its own
                self._draw(self.line(self.tracker.snapshot()))
                self._newline()
            return
        if kind == ev.STEP:
            self._throttle.poke()
        elif kind in _CHECKPOINT_EVENTS:
            self._checkpoint(event.step)
        elif kind in (ev.STOPPING, ev.DONE):
            self._throttle.cancel()
            self._end(self.tracker.snapshot())
        elif self.tty and kind in (ev.SAVE_STARTED, ev.COMMITTED):
            self._throttle.poke(urgent=True)

    # -- terminal --------------------------------------------------------------------------

    def line(self, snap: Snapshot) -> str:
        """The one-line summary: progress, the training since the last verified checkpoint (or
        the warning that it is too much), the last checkpoint, the session clock, free disk."""
        parts = [f"nbresume{' ' + snap.run_name if snap.run_name else ''}: {snap.progress_text()}"]
        # What a crash would lose comes before the last checkpoint, whose failure can be long:
        # a line too wide for the terminal is cut at the end.
        if snap.at_risk.warning:
            parts.append(f"WARNING: {snap.at_risk.warning}")
        elif snap.at_risk.since_text():
            parts.append(snap.at_risk.since_text())
        parts.append(f"last checkpoint {snap.checkpoint_text()}")
        if snap.deadline is not None:
            parts.append(snap.session_text())
        if snap.reshaped is not None:
            before, after = snap.reshaped
            parts.append(f"world size {before} → {after}: reproducible, not identical")
        if snap.free_bytes is not None:
            parts.append(f"{format_bytes(snap.free_bytes)} free")
        wait = self._data_wait()
        if wait is not None and wait.input_bound:
            parts.insert(1, wait.short())  # right after the progress: it explains a slow rate
        elif wait is not None:
            parts.append(wait.short())
        return " · ".join(parts)

    def _data_wait(self) -> DataWaitShare | None:
        """The share of step time the loop waits for batches, once enough were measured."""
        ckpt = self.tracker.checkpointer
        wait = None if ckpt is None else data_wait_of(ckpt)
        return wait if wait is not None and wait.batches >= MIN_BATCHES else None

    def _advise_input_bound(self, wait: DataWaitShare | None) -> None:
        if wait is None or not wait.input_bound or self._input_bound_said:
            return
        self._input_bound_said = True
        if self.tty:
            self._newline()
        self._log(f"input-bound: {wait.advice()}")

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns - 1
        if len(text) > width:
            text = text[: max(0, width - 1)] + "…"
        with self._lock:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)

    def _newline(self) -> None:
        with self._lock:
            if self._width:
                self.stream.write("\n")
                self._width = 0

    # -- both ------------------------------------------------------------------------------

    def _progress(self) -> None:
        snap = self.tracker.snapshot()
        wait = self._data_wait()
        if self.tty:
            self._draw(self.line(snap))
        elif snap.running:
            since = snap.at_risk.since_text()
            text = f"{snap.progress_text()} · {since}" if since else snap.progress_text()
            self._log(f"{text} · {wait.short()}" if wait is not None else text)
        self._advise_input_bound(wait)

    def _checkpoint(self, step: int) -> None:
        snap = self.tracker.snapshot()
        if self.tty:
            self._draw(self.line(snap))
            return
        view = snap.last if snap.last is not None and snap.last.step == step else None
        if snap.failed is not None and snap.failed.step == step:
            view = snap.failed
        if view is None:
            return
        # A state is logged once, and again when its detail changes: how much of the checkpoint
        # the store confirms ("3 of 5 files") is the progress of its upload.
        said = f"{view.state}: {view.detail}" if view.state != SAVED else view.state
        if self._said.get(step) == said:
            return
        self._said[step] = said
        if view.state == FAILED and view is snap.failed:
            self._log(f"saving step {step:,} FAILED: {view.detail}; {snap.at_risk.text(snap.now)}")
        else:
            text = describe(view, snap.now)
            if view.state == SAVED and view.detail:
                text += f" at {view.detail}"
            self._log(text)

    def _end(self, snap: Snapshot) -> None:
        if self.tty:
            self._draw(self.line(snap))
            self._newline()
            return
        if snap.finished:
            self._log(f"done: {snap.progress_text()}")
        else:
            self._log(f"stopped at step {snap.step or 0:,}: {snap.stopped}")

    def _log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._lock:
            self.stream.write(f"[{stamp}] nbresume: {text}\n")
            self.stream.flush()


def attach(tracker: Tracker, stream: TextIO | None = None) -> StatusLine:
    """Show ``tracker``'s run on ``stream`` (stderr by default); once per tracker."""
    for view in tracker.views:
        if isinstance(view, StatusLine):
            return view
    line = StatusLine(tracker, stream)
    tracker.add_view(line)
    return line


def follow(checkpointer: Any) -> None:
    """The default progress of a Checkpointer that nothing else shows (a plain script without
    ``nbresume.init``): the status line on stderr, live on a terminal, log lines otherwise.

    Not after ``nbresume.init`` (which shows the run itself, or nothing with ``quiet=True``),
    not in IPython (a notebook shows the panel once ``%load_ext nbresume`` ran), and only in
    the process that leads a ``torch.distributed`` job (``RANK`` 0).
    """
    from nbresume.notebook.progress import tracker
    from nbresume.notebook.shell import ipython_shell

    if current_run() is not None or ipython_shell() is not None:
        return
    if os.environ.get("RANK", "0") != "0":
        return
    shown = tracker()  # watches every Checkpointer made from now on as well
    attach(shown)
    shown.attach(checkpointer)


def detach(tracker: Tracker) -> None:
    """Stop showing the status line."""
    for view in tracker.views:
        if isinstance(view, StatusLine):
            view._throttle.cancel()
            tracker.remove_view(view)
