"""What the IPython extension (:mod:`nbresume.notebook._extension`) set up in this process:
one tracker, one panel, the shells whose cells it follows. The magics reach it here
(:func:`state`), below the extension that registers them."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from IPython.display import display

from nbresume.checkpoint import forksafe
from nbresume.checkpoint.units import format_bytes
from nbresume.notebook import status_line
from nbresume.notebook._pump import CommPump
from nbresume.notebook.progress import Tracker, tracker

log = logging.getLogger("nbresume")

#: The output type of a widget's view (what ipywidgets 7 and 8 display).
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class ExtensionState:
    """What the extension set up in this process."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.panel: Any = None
        self.pump: CommPump | None = None
        self.displayed = 0  # how many views of the panel were displayed
        #: The panel's outputs (IPython display handles) and the text they hold for where
        #: widgets do not render, brought up to date at the end of each cell.
        self._outputs: list[Any] = []
        self._output_text = ""
        self._shells: list[Any] = []
        self._lock = forksafe.rlock()

    def register(self, shell: Any) -> bool:
        """Cell hooks for ``shell``; ``False`` when it already had them (the caller then
        registers the magics: :func:`nbresume.notebook._extension.load`)."""
        with self._lock:
            if any(s is shell for s in self._shells):
                return False
            self._shells.append(shell)
        shell.events.register("post_execute", self._post_execute)
        shell.events.register("post_run_cell", self._post_run_cell)
        return True

    def unregister(self, shell: Any) -> None:
        with self._lock:
            if not any(s is shell for s in self._shells):
                return
            self._shells = [s for s in self._shells if s is not shell]
        for name, hook in (
            ("post_execute", self._post_execute),
            ("post_run_cell", self._post_run_cell),
        ):
            with contextlib.suppress(ValueError):
                shell.events.unregister(name, hook)
        if self.panel is not None:
            self.tracker.remove_view(self.panel)

    def _post_execute(self) -> None:
        # The cell is over: messages held back while it ran go back to the kernel, in order.
        if self.pump is not None:
            self.pump.give_back()

    def _post_run_cell(self, result: Any = None) -> None:
        self.tracker.cell_finished()
        self._update_outputs()

    def _panel_output(self) -> dict[str, Any]:
        """The panel's output: the widget, and a text of the run instead of the widget's
        repr (truncated HTML) for papermill's and nbconvert's output and other text views."""
        self._output_text = self.panel.plain_text()
        view = {"version_major": 2, "version_minor": 0, "model_id": self.panel.widget.model_id}
        return {"text/plain": self._output_text, _WIDGET_VIEW: view}

    def _update_outputs(self) -> None:
        if self.panel is None or not self._outputs:
            return
        try:
            if self.panel.plain_text() == self._output_text:
                return
            output = self._panel_output()
            for handle in self._outputs:
                handle.update(output, raw=True)
        except Exception:  # a display must never fail the user's cell
            log.exception("nbresume: updating the panel's output failed")

    def ensure_panel(self, shell: Any) -> Any:
        """The panel of this process (created once), listening to the tracker."""
        from nbresume.notebook.panel import Panel

        with self._lock:
            if self.panel is None:
                self.pump = CommPump.for_shell(shell)
                self.panel = Panel(self.tracker, pump=self.pump)
                self.tracker.on_step(self.panel.pump_messages)
            self.tracker.add_view(self.panel)
            return self.panel

    def display_panel(self, *, again: bool = True) -> None:
        """Show the panel when running in a notebook kernel; another view of the same panel
        unless ``again`` is false and it is already shown."""
        shell = _shell()
        if shell is None or getattr(shell, "kernel", None) is None:
            return
        try:
            self.ensure_panel(shell)
        except ImportError as exc:  # no ipywidgets in this kernel: log lines instead
            if not self.displayed:
                print(f"nbresume: no panel ({exc}): pip install ipywidgets, restart the kernel")
                status_line.attach(self.tracker, sys.stdout)
                self.displayed += 1
            return
        if self.displayed and not again:
            return
        handle = display(self._panel_output(), raw=True, display_id=True)  # type: ignore[no-untyped-call]
        if handle is not None:
            self._outputs.append(handle)
        self.displayed += 1

    def tracker_status_text(self) -> str:
        """A few lines: the run, training progress, the last checkpoint, the session."""
        snap = self.tracker.snapshot()
        head = "nbresume"
        if snap.run_name:
            head += f" · run {snap.run_name!r}"
        if snap.folder:
            free = f" ({format_bytes(snap.free_bytes)} free)" if snap.free_bytes else ""
            head += f" · checkpoints in {snap.folder}{free}"
        lines = [head]
        lines.append(f"  training: {snap.progress_text()}")
        lines.append(f"  last checkpoint: {snap.checkpoint_text()}")
        lines.append(f"  session: {snap.session_text()}")
        if snap.verdict:
            lines.append(f"  preflight: {snap.verdict}")
        for fact in snap.facts:
            if fact.status != "ok":
                lines.append(f"    {fact.status} {fact.label}: {fact.text}")
        return "\n".join(lines)


_STATE = forksafe.Lazy(lambda: ExtensionState(tracker()))


def state() -> ExtensionState:
    """The extension's state in this process (created on first use)."""
    return _STATE.get()


def _shell() -> Any:
    from IPython import get_ipython

    return get_ipython()
