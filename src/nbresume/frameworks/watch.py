"""A training loop nbresume does not run, made to look like a Checkpointer.

A framework (the Hugging Face Trainer, Lightning) runs its own loop and writes its own
checkpoints. :class:`Watch` gives such a loop what a
:class:`~nbresume.checkpoint.loop.Checkpointer` has: the notebook panel and the
status line find it (:func:`nbresume.checkpoint.events.announce`) and show its step, total,
checkpoints and deadline; SIGTERM / SIGUSR1 / an interrupt / the panel's buttons / the session
deadline become requests that the framework's callback answers at its next step boundary; each
save reports ``save_started``, ``committed``, ``verified`` (and ``syncing`` / ``durable`` on
Google Drive), and its measured cost sizes the deadline's margin, as the Checkpointer's do.

The framework's callback drives it::

    watch = Watch(store, deadline="auto")
    watch.start(step=trainer_step, total=max_steps)       # the loop begins (main thread)
    ...                                                   # at every step boundary:
    watch.step_done(step)
    reason, save = watch.decide()                         # agreed over a torch.distributed job
    if reason: save, then watch.stopping(step, reason), end the loop
    elif save: save
    ...                                                   # each save:
    info = watch.commit(step, lambda on_committed: pending.commit(on_committed=on_committed))
    watch.finish(step, done=True)                         # the loop ended

Under ``torch.distributed`` (more than one process), every rank runs its own watch: a signal
reaches one rank, each rank's deadline is measured by its own clock, the panel's button is
pressed in one process. :meth:`Watch.decide` combines the ranks' requests at every step
boundary in one small ``all_reduce`` (:meth:`nbresume.checkpoint.parallel.Group.agree`), so
that every rank saves the same step and stops there: a rank that saved alone (the frameworks'
saves hold barriers) while another went on to the next step's collectives would hang the job.
Only rank 0 announces itself to the panel and the status line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nbresume.checkpoint import events as ev
from nbresume.checkpoint.loop import (
    ControlledLoop,
    DurabilityWatcher,
    LoopControl,
    SaveFunction,
    confirm,
    report_save,
)
from nbresume.checkpoint.parallel import Group, current_group
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore, PendingCheckpoint
from nbresume.errors import UsageError

if TYPE_CHECKING:
    from nbresume.checkpoint.loop import Confirmation

log = logging.getLogger("nbresume")


class Watch(ControlledLoop):
    """The panel's, the status line's and the stop machinery's view of a framework's loop.

    Args:
        store: the checkpoint store the framework's checkpoints are committed to.
        deadline: ``"auto"`` (the platform's session cap), seconds from now, a duration or
            ``None``, as for the Checkpointer.
        callbacks: callables that receive every :class:`~nbresume.checkpoint.events.Event`.
        announce: tell the notebook panel and the status line about this loop now (a
            framework passes it for rank 0 only of a ``torch.distributed`` job).

    Attributes read by the panel and the status line: :attr:`events`, :attr:`store`,
    :attr:`step`, :attr:`total`, :attr:`epoch`, :attr:`deadline`, :attr:`deadline_source`,
    :attr:`stop_at`, :attr:`cadence`, :attr:`durability`.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        deadline: float | int | str | None = "auto",
        callbacks: list[ev.Callback] | None = None,
        announce: bool = True,
    ) -> None:
        self.store = store
        #: When the loop saves and stops. Saves happen when the framework decides: the
        #: cadence only learns their cost.
        self.control = LoopControl(store, every=None, deadline=deadline, callbacks=callbacks)
        #: Saves the framework's state now and returns the verified checkpoint: what the
        #: panel's "Save now" and ``%nbresume save`` call between cells. Set by the framework.
        self.save_now: Callable[[], CheckpointInfo | None] | None = None
        self.step = 0
        self.total: int | None = None
        self.epoch: int | None = None
        self.running = False
        self.restored_step: int | None = None
        self._step_started: float | None = None
        #: Followers of the other stores a framework saves to (by location), on Drive.
        self._watchers: dict[str, DurabilityWatcher] = {}
        #: The job's processes while a loop runs under ``torch.distributed`` with more than
        #: one (``None`` with one process: nothing is ever exchanged).
        self.group: Group | None = None
        if announce:
            ev.announce(self)

    # -- the loop control's, as the watch's own ------------------------------------------

    @property
    def started(self) -> bool:
        """Whether the framework's loop has begun (it has restored, if it resumes)."""
        return self.running or self.restored_step is not None

    @property
    def signum(self) -> int | None:
        """The stop signal received in the running loop (``None``: none)."""
        return self.control.signum

    # -- the loop -----------------------------------------------------------------------

    def start(self, step: int = 0, total: int | None = None, *, epoch: int | None = None) -> None:
        """The loop begins at ``step`` (of ``total``): requests made before it are dropped,
        and in the main thread the stop signals become requests (never a write in a handler)."""
        self.step, self.total, self.epoch = step, total, epoch
        #: The step the loop resumed from (``None`` for a fresh start): the panel counts the
        #: training at risk from there.
        self.restored_step = step or None
        self.control.save_asked = False
        self.control.begin(step, steered=False)
        self.control.signum = None
        self.running = True
        self._step_started = time.monotonic()
        self.group = current_group()
        self.control.hold_signals()

    def step_done(self, step: int, *, total: int | None = None, epoch: int | None = None) -> None:
        """A step boundary: ``step`` steps are done. Reports progress and learns the step's
        time (for the deadline's margin)."""
        now = time.monotonic()
        if self._step_started is not None and step > self.step:
            self.cadence.observe_step((now - self._step_started) / (step - self.step))
        self._step_started = now
        self.step = step
        if total is not None:
            self.total = total
        if epoch is not None:
            self.epoch = epoch
        self.events.emit(ev.STEP, step, total=self.total, epoch=self.epoch)

    def stop_reason(self) -> str:
        """Why the loop must save and stop at this step boundary: a request (the panel), a
        signal, or the deadline near; ``""`` to go on."""
        return self.control.why_stop(self.step)

    def decide(self) -> tuple[str, bool]:
        """At a step boundary: why the loop must save and stop (``""`` to go on), and whether
        to save (the save request is answered).

        Under ``torch.distributed`` with more than one process, every rank must call it at
        every step boundary: the ranks combine their requests in one small ``all_reduce``, so
        that a signal, a deadline or a request seen by any rank stops every rank at this same
        step. A rank stopped by another's signal ends as that signal asks (:meth:`finish`)."""
        group = self.group
        decision = self.control.decide(
            self.step, None if group is None else group.agree, on_cadence=False
        )
        return decision.stop, decision.save

    @property
    def leads(self) -> bool:
        """Whether this process leads the job (rank 0, or the only process)."""
        return self.group is None or self.group.rank == 0

    def save_requested(self) -> bool:
        """Whether a save was asked for since the last call (the flag is cleared)."""
        return self.control.take_save_request()

    # -- saves --------------------------------------------------------------------------

    def save_started(self, step: int) -> float:
        """The framework starts writing the checkpoint of ``step`` now: report it, and return
        the time to hand to :meth:`commit` (the save's cost counts from here). A framework
        that writes its own folder (the Trainer) does not pass through the store's cleanup,
        so the removal of what retention deleted is waited for here: the new checkpoint
        finds the disk space the synchronous removal used to leave."""
        self.store.wait_removals()
        self.events.emit(ev.SAVE_STARTED, step)
        return time.monotonic()

    def commit(
        self,
        step: int,
        save: SaveFunction,
        *,
        started: float | None = None,
        store: CheckpointStore | None = None,
    ) -> CheckpointInfo:
        """Run one save and report it: ``save_started`` (unless :meth:`save_started` did),
        ``committed``, ``verified`` (or ``failed``, and the error is raised), its cost learnt,
        and on Google Drive ``syncing`` until the durable store confirms it (then ``durable``).

        ``store`` is where the checkpoint lands when it is not the watch's own store (a
        framework that writes several checkpoint folders, such as Lightning's ``.ckpt``s)."""
        return report_save(
            self.events,
            self.cadence,
            step,
            save,
            started=started,
            track=lambda i: self.track(i, store),
        )

    def track(self, info: CheckpointInfo, store: CheckpointStore | None = None) -> None:
        """On a write-back store (Google Drive's mount), report ``info`` as ``syncing`` until
        the durable store confirms it (then ``durable``); elsewhere nothing to follow."""
        if store is None or store.location == self.store.location:
            watcher = self.durability
        elif not store.backend.write_back:
            watcher = None
        else:
            watcher = self._watchers.get(store.location)
            if watcher is None:
                watcher = self._watchers[store.location] = DurabilityWatcher(store, self.events)
        if watcher is not None:
            watcher.track(info)  # "syncing" until the durable store confirms it

    def commit_pending(
        self,
        pending: PendingCheckpoint,
        metrics: dict[str, float] | None = None,
        *,
        started: float | None = None,
    ) -> CheckpointInfo:
        """:meth:`commit` of a pending checkpoint whose files are all in."""
        return self.commit(
            pending.step,
            lambda on_committed: pending.commit(metrics, on_committed=on_committed),
            started=started,
        )

    def save(
        self, step: int | None = None, *, block: bool = True, **_: Any
    ) -> CheckpointInfo | None:
        """Save now, between cells (the panel's "Save now", ``%nbresume save``): through the
        framework's :attr:`save_now`."""
        if self.save_now is None:
            latest = self.store.latest()
            newest = (
                f"the newest checkpoint is step {latest.step:,}"
                if latest is not None
                else "there is no checkpoint yet"
            )
            raise UsageError(
                "no training is running, and this framework saves only from inside its loop; "
                f"{newest}",
                where=self.store.location,
                fix="run the training cell: while it runs, Save now saves at the next step",
            )
        return self.save_now()

    def wait(self, *, durable: bool = False, timeout: float | None = None) -> Confirmation | None:
        """Saves through a watch are blocking: nothing is ever in flight. With ``durable``, wait
        until the storage itself confirms the newest checkpoint, as
        :meth:`Checkpointer.wait <nbresume.checkpoint.loop.Checkpointer.wait>` does."""
        return confirm(self.store, timeout=timeout) if durable else None

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint."""
        return self.store.latest()

    # -- the end ------------------------------------------------------------------------

    def stopping(self, step: int, reason: str) -> None:
        """The loop saved ``step`` and stops for ``reason``: report it."""
        self.step = step
        self.control.stopped(step, reason)

    def finish(self, step: int, *, done: bool) -> None:
        """The loop ended at ``step`` (``done``: it ran to its end). Restores the signal
        handlers; waits for the removal of the checkpoints retention deleted; reports
        ``done``. After a stop on a signal, runs the after-stop action
        (a Slurm requeue) and ends the process as the signal would have: ``KeyboardInterrupt``
        for an interrupt, else ``SystemExit(128 + signum)``."""
        self.step = step
        self.running = False
        # What retention deleted is off the disk before the user's next cell archives the folder.
        self.store.wait_removals()
        self.control.restore_signals()
        if done:
            self.events.emit(ev.DONE, step)
        signum, self.control.signum = self.control.signum, None
        if signum is None or done:
            return
        self.control.end_for_signal(signum, step, leads=self.leads)

    def close(self) -> None:
        """Restore the signal handlers and stop following Drive uploads."""
        self.control.close()
        for watcher in self._watchers.values():
            watcher.close()

    def __repr__(self) -> str:
        return f"Watch({self.store.location!r}, step={self.step})"


__all__ = ["SaveFunction", "Watch"]
