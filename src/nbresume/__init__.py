"""nbresume: long PyTorch training that survives Colab, Kaggle, SSH boxes, Slurm and Kubernetes.

A checkpoint that nbresume reports as saved is really there, loads, and resumes the run
exactly. ``import nbresume`` is light: torch, IPython and ipywidgets are imported only where
they are used.
"""

from __future__ import annotations

from typing import Any

from nbresume import knobs as _knobs
from nbresume.checkpoint import events as _events
from nbresume.checkpoint import hooks as _hooks
from nbresume.checkpoint.events import Event
from nbresume.checkpoint.loop import Checkpointer
from nbresume.checkpoint.state import (
    BaseMismatchError,
    ResumableLoader,
    TrainableOnly,
    sample_generator,
    sample_seed,
    trainable_only,
)
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    VerifyReport,
    VerifyResult,
    verify,
)
from nbresume.checkpoint.version import __version__
from nbresume.errors import (
    ArgumentError,
    CheckpointError,
    CorruptCheckpointError,
    FolderInUseError,
    LeaseLostError,
    NbresumeError,
    NoCheckpointError,
    PreflightError,
    StorageError,
    StorageFullError,
    UsageError,
)
from nbresume.platforms import session_deadline as _session_deadline
from nbresume.platforms.cgroup import available_memory as _available_memory
from nbresume.platforms.cgroup import cap_threads
from nbresume.platforms.cgroup import read_cpu as _read_cpu
from nbresume.preflight_checks import Check, Report, preflight
from nbresume.run import Run, current_run, init
from nbresume.run import provide_display as _provide_display
from nbresume.slurm import after_stop_save as _slurm_after_stop_save

# The checkpoint core imports nothing above it: the platform's facts are handed to it here.
_hooks.provide_session_deadline(_session_deadline)
_hooks.provide_after_stop_save(_slurm_after_stop_save)  # in a Slurm job: ask for a requeue
_hooks.provide_usable_cpus(lambda: _read_cpu().usable)
_hooks.provide_available_memory(_available_memory)  # a save's host copy must fit in it


def _steering() -> _hooks.Steering:
    # `nbresume smoke` and `nbresume check` steer the script they run through its environment.
    return _hooks.Steering(
        smoke_steps=_knobs.smoke_steps(),
        smoke_reason=f"smoke run: stopped after the steps {_knobs.SMOKE_STEPS.name} allows",
        stop_at_step=_knobs.stop_at_step(),
        stop_at_reason=f"the budget of `nbresume check` ({_knobs.STOP_AT_STEP.name})",
        save_every=_knobs.save_every(),
        folder=_knobs.check_dir,
    )


_hooks.provide_steering(_steering)
if _knobs.CHECK_DIR.raw().strip():
    # A run of `nbresume check`: the script's globals are noted at its end, so that the check
    # sees which of them (an environment's own generator, a counter) a resume did not carry.
    # What each save held is noted too, to find the first save where two runs differ.
    from nbresume.resumecheck.observe import note_at_exit as _note_at_exit
    from nbresume.resumecheck.saves import note_saves as _note_saves

    _note_at_exit(_knobs.CHECK_DIR.raw().strip())
    _hooks.provide_after_save(_note_saves(_knobs.CHECK_DIR.raw().strip()))
# A Checkpointer that nothing shows (a plain script without init) shows a status line on stderr.


def _follow(checkpointer: object) -> None:
    # Imported when a Checkpointer starts, not with nbresume: a script that never trains
    # loads nothing of the display.
    from nbresume.notebook.status_line import follow

    follow(checkpointer)


_events.provide_default_watcher(_follow)


def _show_new_run(run: Run) -> None:
    # How nbresume.init shows a run: the notebook layer, imported only when a run starts.
    from nbresume.notebook import show_new_run

    show_new_run(run)


_provide_display(_show_new_run)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbresume``: the preflight, the panel and the ``%nbresume`` magics. IPython
    and ipywidgets are imported here, never by ``import nbresume``."""
    from nbresume.notebook import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbresume``."""
    from nbresume.notebook import unload_ipython_extension as unload

    unload(ipython)


__all__ = [
    "ArgumentError",
    "BaseMismatchError",
    "Check",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "Checkpointer",
    "CorruptCheckpointError",
    "Event",
    "FolderInUseError",
    "LeaseLostError",
    "LoadedCheckpoint",
    "NbresumeError",
    "NoCheckpointError",
    "PreflightError",
    "Report",
    "ResumableLoader",
    "Run",
    "StorageError",
    "StorageFullError",
    "TrainableOnly",
    "UsageError",
    "VerifyReport",
    "VerifyResult",
    "__version__",
    "cap_threads",
    "current_run",
    "init",
    "preflight",
    "sample_generator",
    "sample_seed",
    "trainable_only",
    "verify",
]
