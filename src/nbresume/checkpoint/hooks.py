"""Facts and actions of the platform layer that the core uses, registered from above.

The protocol: nothing under ``checkpoint/`` imports a platform module. The layer above
(``nbresume/__init__.py``) registers, once, at import:

- where the session deadline comes from (:func:`provide_session_deadline`), which
  ``deadline="auto"`` asks for through :func:`session_deadline`; no provider: no cap;
- the action after a stop-save on a signal (:func:`provide_after_stop_save`), which a
  :class:`~nbresume.checkpoint.loop.Checkpointer` takes from :data:`after_stop_save`
  as its ``after_stop`` when it is made; ``None``: no action;
- how many CPUs this container may really use (:func:`provide_usable_cpus`), which the
  input-bound advice asks for through :func:`usable_cpus`; no provider: unknown;
- how much memory this process may still allocate (:func:`provide_available_memory`: its
  cgroup's limit, the host's available memory), which a save asks for through
  :func:`available_memory` before it copies the state into host memory; no provider:
  unknown. The process's own address-space limit (``RLIMIT_AS``) counts whatever the
  provider says;
- how nbresume's own tools steer the loops of a script they run (:func:`provide_steering`:
  ``nbresume smoke`` stops every loop a few steps in, ``nbresume check`` saves every N steps,
  stops at step N and keeps the checkpoints in folders of its own), which the loop control
  asks for through :func:`steering`; no provider: no steering;
- what is done with each checkpoint a save committed (:func:`provide_after_save`: in a run
  of ``nbresume check``, what it holds is noted), which the saver calls as
  :data:`after_save`; ``None``: nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nbresume.checkpoint import procfs
from nbresume.checkpoint.units import format_bytes


def _own_folder(original: object) -> str | None:
    return None


@dataclass(frozen=True)
class Steering:
    """How a tool of nbresume's that runs the user's script steers its training loops."""

    #: Every loop stops this many steps after it starts (``nbresume smoke``), and why.
    smoke_steps: int | None = None
    smoke_reason: str = "smoke run"
    #: Every loop stops at this step (``nbresume check``: the same step in every run), and why.
    stop_at_step: int | None = None
    stop_at_reason: str = "stopped at a step set by nbresume"
    #: Every Checkpointer saves every this many steps, whatever its ``every=``.
    save_every: int | None = None
    #: Where a Checkpointer's folder goes instead (``None``: where the script says).
    folder: Callable[[object], str | None] = field(default=_own_folder)


_session_deadline: Callable[[], tuple[float | None, str]] | None = None
_usable_cpus: Callable[[], int | None] | None = None
_available_memory: Callable[[], tuple[int | None, str]] | None = None
_steering: Callable[[], Steering] | None = None

#: ``after_stop_save(signum, step)``: called by the process that leads the job once the
#: checkpoint of ``step`` is saved on the stop signal ``signum``, just before the process
#: exits (inside a Slurm job, :func:`nbresume.slurm.after_stop_save` asks to be requeued). It
#: must not raise.
after_stop_save: Callable[[int, int], object] | None = None


#: ``after_save(info)``: called with each checkpoint a save committed and verified, in the
#: thread that saved it, before the save is reported (in a run of ``nbresume check``, what it
#: holds is noted, to find the first save where two runs differ). It must not raise.
after_save: Callable[[object], None] | None = None


def provide_session_deadline(provider: Callable[[], tuple[float | None, str]] | None) -> None:
    """Register ``provider() -> (unix time or None, what the limit is called)``."""
    global _session_deadline  # noqa: PLW0603 -- this module is the registry
    _session_deadline = provider


def session_deadline() -> tuple[float | None, str]:
    """When the platform ends this session (a Unix time, or ``None``) and what that limit is
    called; ``(None, "")`` when no provider is registered."""
    return _session_deadline() if _session_deadline is not None else (None, "")


def provide_after_stop_save(action: Callable[[int, int], object] | None) -> None:
    """Register the action after a stop-save on a signal."""
    global after_stop_save  # noqa: PLW0603 -- this module is the registry
    after_stop_save = action


def provide_after_save(action: Callable[[object], None] | None) -> None:
    """Register the action after each save (called with its ``CheckpointInfo``)."""
    global after_save  # noqa: PLW0603 -- this module is the registry
    after_save = action


def provide_usable_cpus(provider: Callable[[], int | None] | None) -> None:
    """Register ``provider() -> CPUs usable by this container`` (its cgroup quota)."""
    global _usable_cpus  # noqa: PLW0603 -- this module is the registry
    _usable_cpus = provider


def usable_cpus() -> int | None:
    """The CPUs this container may use, from the registered provider; ``None`` when unknown
    (no provider, or the provider failed: the answer only shapes advice)."""
    try:
        return _usable_cpus() if _usable_cpus is not None else None
    except Exception:
        return None


def provide_available_memory(provider: Callable[[], tuple[int | None, str]] | None) -> None:
    """Register ``provider() -> (bytes this process may still allocate or None, what bounds
    them)`` (its cgroup's limit, the host's available memory)."""
    global _available_memory  # noqa: PLW0603 -- this module is the registry
    _available_memory = provider


def available_memory() -> tuple[int | None, str]:
    """The bytes this process may still allocate and what bounds them: the registered
    provider's answer, or the room under this process's address-space limit (``RLIMIT_AS``)
    where that is less; ``(None, "")`` when unknown (no provider, or the provider failed,
    and no such limit)."""
    try:
        found = _available_memory() if _available_memory is not None else (None, "")
    except Exception:
        found = None, ""
    room, limit = procfs.address_space_room()
    if room is not None and limit is not None and (found[0] is None or room < found[0]):
        return room, f"under the address-space limit (ulimit -v) of {format_bytes(limit)}"
    return found


def provide_steering(provider: Callable[[], Steering] | None) -> None:
    """Register ``provider() -> Steering``: how nbresume's own tools steer this process's loops."""
    global _steering  # noqa: PLW0603 -- this module is the registry
    _steering = provider


def steering() -> Steering:
    """How this process's loops are steered (no steering when no provider is registered). A
    provider that refuses its settings raises: a tool's wrong setting is an error."""
    return _steering() if _steering is not None else Steering()
