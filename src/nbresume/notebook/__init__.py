"""nbresume in a notebook and in a terminal: the panel, the magics, the status line.

``%load_ext nbresume`` (or ``nbresume.init`` inside a notebook) shows the panel and registers
``%nbresume`` / ``%%nbresume once``; outside a notebook ``nbresume.init`` shows the same
information as one status line. This module itself is light: IPython and ipywidgets are
imported only when a notebook is actually there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbresume.notebook.shell import in_notebook
from nbresume.notebook.shell import ipython_shell as _ipython_shell

if TYPE_CHECKING:
    from nbresume.run import Run


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbresume``."""
    from nbresume.notebook import _extension

    _extension.load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbresume``."""
    from nbresume.notebook import _extension

    _extension.unload(ipython)


def show(run: Run | None = None) -> None:
    """Show the run live where we are: the panel in a notebook, a status line on stderr
    elsewhere (redrawn in place on a terminal, plain log lines in a file)."""
    from nbresume.notebook import status_line
    from nbresume.notebook.progress import tracker

    if run is not None:
        tracker().set_run(run)
    shell = _ipython_shell()
    if shell is not None:
        from nbresume.notebook import _extension

        _extension.show(shell)
    else:
        status_line.attach(tracker())


def show_new_run(run: Run) -> None:
    """What ``nbresume.init`` shows of a new run: in a notebook the setup panel first (Drive,
    the Kaggle inputs, the clocks), elsewhere its text the first time in a process; then the
    run live (:func:`show`)."""
    from nbresume.notebook import setup_panel

    if in_notebook():
        print(run.summary())
        setup_panel.show(run=run)
    elif not setup_panel.print_text(run):
        print(run.summary())
    show(run)


def hide() -> None:
    """Stop the status line (the panel stays where it was displayed)."""
    from nbresume.notebook import status_line
    from nbresume.notebook.progress import tracker

    status_line.detach(tracker())


__all__ = [
    "hide",
    "in_notebook",
    "load_ipython_extension",
    "show",
    "show_new_run",
    "unload_ipython_extension",
]
