"""The IPython extension behind ``%load_ext nbresume`` (and ``nbresume.init`` in a notebook).

Loading runs the preflight (or takes the report of the last ``nbresume.init``), registers the
magics, hooks the end of each cell, and shows the run: the panel in a notebook kernel, the
status line in a terminal IPython. Everything is done once per process however often it is
loaded: one tracker, one panel, one set of hooks, one magic.
"""

from __future__ import annotations

from typing import Any

from nbresume.notebook import magics, status_line
from nbresume.notebook.extension_state import ExtensionState, state
from nbresume.preflight_checks import preflight
from nbresume.run import current_run


def load(shell: Any) -> None:
    """``%load_ext nbresume``: preflight, magics, and the panel (or the status line)."""
    st = state()
    if not st.register(shell):
        print("nbresume is already loaded: `%nbresume status` shows the run")
        return
    magics.register(shell)
    run = current_run()
    if run is not None:
        st.tracker.set_run(run)
        report = run.report
    else:
        report = preflight()
        st.tracker.set_report(report)
    if getattr(shell, "kernel", None) is not None:
        from nbresume.notebook import setup_panel

        setup_panel.show(report, run)
        st.display_panel(again=False)
    else:
        print("\n".join(report.summary_lines()))
        status_line.attach(st.tracker)


def unload(shell: Any) -> None:
    """``%unload_ext nbresume``: the hooks go; the magic stays until IPython restarts."""
    state().unregister(shell)


def show(shell: Any) -> None:
    """``nbresume.init`` inside IPython: magics and hooks, and the panel in a notebook."""
    st = state()
    if st.register(shell):
        magics.register(shell)
    if getattr(shell, "kernel", None) is not None:
        st.display_panel(again=False)  # after %load_ext, one panel is enough
    else:
        status_line.attach(st.tracker)


__all__ = ["ExtensionState", "load", "show", "state", "unload"]
