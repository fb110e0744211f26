"""When a training loop saves and when it stops: one :class:`LoopControl`, whoever runs the loop.

The :class:`~nbresume.checkpoint.loop.Checkpointer` runs its own loops (``steps()``,
``epochs()``); a framework (the Hugging Face Trainer, Lightning) runs its own and reaches
nbresume through a :class:`~nbresume.frameworks.watch.Watch`. Both hold one ``LoopControl``,
which keeps everything that decides, at a step boundary, whether to save and whether to stop:

- the deadline and its margin (enough time for one more step and a save, measured);
- the stop signals (SIGTERM, SIGINT, SIGUSR1), turned into requests in the main thread and
  answered at the next step boundary, never by a write in the handler;
- the requests from any thread (the panel's buttons, ``%nbresume save``) and their reasons;
- the cadence (every N steps, a duration, ``"auto"``), which learns each save's cost;
- the steering of nbresume's own tools (``nbresume smoke``, ``nbresume check``), handed in as
  a value (:func:`nbresume.checkpoint.hooks.steering`);
- the job-wide agreement of a ``torch.distributed`` job, as named :class:`BoundaryFlags`;
- the action after a stop-save on a signal (a Slurm requeue) and the way the process ends;
- the event bus and the durability watcher (Drive's ``syncing`` until ``durable``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Protocol, runtime_checkable

from nbresume.checkpoint import events as ev
from nbresume.checkpoint import hooks
from nbresume.checkpoint.loop import stops
from nbresume.checkpoint.loop.cadence import Cadence
from nbresume.checkpoint.loop.deadline import resolve_deadline
from nbresume.checkpoint.loop.durability import DurabilityWatcher
from nbresume.checkpoint.store import CheckpointInfo, CheckpointStore

log = logging.getLogger("nbresume")

#: What a job's processes exchange at a step boundary: the element-wise maximum of each
#: process's flags (``torch.distributed``'s ``all_reduce``; the flags themselves with one).
Agree = Callable[[Sequence[int]], Sequence[int]]


@dataclass(frozen=True)
class BoundaryFlags:
    """What a process brings to a step boundary, and, once agreed, what the job does there.

    Agreed over a job, each flag is the maximum over its processes: one process's stop (a
    signal, the deadline, a request) stops them all at the same step.
    """

    #: Save and stop here.
    stop: bool = False
    #: The stop signal received (0: none); every process then ends as that signal asks.
    signum: int = 0
    #: A save was asked for (the panel, ``%nbresume save``).
    save: bool = False
    #: The cadence says a save is due (the leading process's clock decides).
    due: bool = False
    #: A background save failed.
    failed: bool = False

    def agreed(self, agree: Agree | None) -> BoundaryFlags:
        """These flags combined with the other processes' (``agree``: none with one process)."""
        if agree is None:
            return self
        stop, signum, save, due, failed = agree(
            [int(self.stop), self.signum, int(self.save), int(self.due), int(self.failed)]
        )
        return BoundaryFlags(bool(stop), int(signum), bool(save), bool(due), bool(failed))


@dataclass(frozen=True)
class Decision:
    """What the loop does at a step boundary, agreed over the job (:meth:`LoopControl.decide`)."""

    #: Save and stop, for this reason (``""``: go on).
    stop: str = ""
    #: The stop signal of the job (0: none): once saved, every process ends as it asks.
    signum: int = 0
    #: Save here and go on (asked for, or due on the cadence).
    save: bool = False
    #: A background save failed (in any process of the job).
    failed: bool = False


@dataclass
class LoopExit:
    """How the running loop may be left: a body left by ``break`` is the run's end, one left
    by an exception is not (the newest checkpoint is where to resume)."""

    #: The running loop and its bound (``("steps", total)`` or ``("epochs", count)``).
    bound: tuple[str, int] | None = None
    #: Where a body left early ended: the (step, epoch) its save records.
    left_at: tuple[int, int] | None = None
    #: The last exception no one handled when the loop started (``sys.last_exc``).
    unhandled_at_start: object = None
    #: Whether a loop runs now (a loop inside it, or in another thread, changes nothing).
    running: bool = False


class LoopControl:
    """When a loop saves and when it stops (see the module's docstring).

    Args:
        store: the checkpoint store the loop saves to (its backend says whether the
            durability watcher follows Drive's uploads).
        every: the cadence: steps, a duration, ``"auto"``, or ``None`` (the framework decides).
        deadline: ``"auto"`` (the platform's session cap), seconds from now, a duration or
            ``None``.
        callbacks: callables that receive every :class:`~nbresume.checkpoint.events.Event`.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        every: int | float | str | None = None,
        deadline: float | int | str | None = "auto",
        callbacks: list[ev.Callback] | None = None,
    ) -> None:
        self.events = ev.EventBus(callbacks)
        self.cadence = Cadence(every)
        #: Follows checkpoints on a write-back store (Drive) until the durable copy matches.
        self.durability = (
            DurabilityWatcher(store, self.events) if store.backend.write_back else None
        )
        self.deadline, self.deadline_source = resolve_deadline(deadline)
        #: A deadline the user gave has no floor on its margin; a platform's cap has one.
        self.explicit_deadline = deadline not in (None, "auto")
        #: Called after a stop-save on a signal, before the exit (a Slurm job asks to be
        #: requeued): ``after_stop(signum, step)``, by the process that leads the job.
        self.after_stop = hooks.after_stop_save
        #: The stop signal received while a loop runs (``None``: none).
        self.signum: int | None = None
        #: Why the last loop stopped early (``""``: it did not).
        self.stop_reason = ""
        self.save_asked = False  # set from any thread by request_save()
        self.stop_asked = ""  # set from any thread by request_stop()
        #: The step at which nbresume's own tools stop this loop, and why (``nbresume smoke``,
        #: ``nbresume check``); ``None``: they do not.
        self.steered_stop: tuple[int, str] | None = None
        self.saved_step: int | None = None
        self.saved_at = time.monotonic()
        #: The running loop, and where a body left by ``break`` ends the run.
        self.exit = LoopExit()
        self._previous: dict[int, object] | None = None

    # -- requests, from any thread ------------------------------------------------------

    def request_save(self) -> None:
        """Ask for a save at the next step boundary. Safe from any thread (a panel's button,
        a handler): the save itself always happens in the training loop."""
        self.save_asked = True

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the running loop to save at the next step boundary and stop. Safe from any
        thread; a request made while no loop runs is dropped when the next loop starts."""
        self.stop_asked = reason or "stop requested"

    def take_save_request(self) -> bool:
        """Whether a save was asked for since the last call (the request is answered)."""
        asked, self.save_asked = self.save_asked, False
        return asked

    # -- the loop's life ------------------------------------------------------------------

    def begin(self, step: int, *, steered: bool = True) -> None:
        """A loop begins at ``step``: requests made before it, and the reason the last one
        stopped, are not meant for it; with ``steered``, nbresume's own tools set where it
        stops (a framework's loop is run to the steps its own arguments give)."""
        self.stop_asked = ""
        self.stop_reason = ""
        steering = hooks.steering() if steered else hooks.Steering()
        if steering.smoke_steps is not None:
            self.steered_stop = (step + steering.smoke_steps, steering.smoke_reason)
        elif steering.stop_at_step is not None:
            self.steered_stop = (steering.stop_at_step, steering.stop_at_reason)
        else:
            self.steered_stop = None

    def saved(self, step: int) -> None:
        """A save of ``step`` starts now: the cadence counts from here."""
        self.saved_step = step
        self.saved_at = time.monotonic()

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """While the loop runs in the main thread, the stop signals become requests answered
        at the next step boundary (a second interrupt stops at once); the user's handlers are
        back after it. Elsewhere (another thread, a loop inside a loop) nothing changes."""
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            yield
            return
        self.signum = None
        self._previous = stops.install(self.on_signal)
        try:
            yield
        finally:
            self.restore_signals()

    def hold_signals(self) -> None:
        """Route the stop signals here until :meth:`restore_signals` (a framework's loop,
        which begins and ends in two calls). Only in the main thread; once."""
        if self._previous is None and threading.current_thread() is threading.main_thread():
            self.signum = None
            self._previous = stops.install(self.on_signal)

    def restore_signals(self) -> None:
        """Put back the handlers the loop replaced."""
        previous, self._previous = self._previous, None
        if previous is not None:
            stops.restore(previous)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """A stop signal: a request (a second interrupt raises at once)."""
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    # -- a step boundary --------------------------------------------------------------------

    def margin(self) -> float:
        """Enough time before the deadline for one more step and a save, measured."""
        return stops.deadline_margin(self.cadence, explicit=self.explicit_deadline)

    @property
    def stop_at(self) -> float | None:
        """When the loop saves and stops for the deadline (a Unix time), with the margin as
        measured now; ``None`` without a deadline."""
        return None if self.deadline is None else self.deadline - self.margin()

    def why_stop(self, step: int) -> str:
        """Why the loop must save and stop at this boundary: a request, nbresume's own tools,
        a signal, the deadline near; ``""`` to go on."""
        if self.stop_asked:
            return self.stop_asked
        if self.steered_stop is not None and step >= self.steered_stop[0]:
            return self.steered_stop[1]
        if self.signum is not None:
            return stops.signal_reason(self.signum)
        return stops.deadline_reason(self.deadline, self.deadline_source, self.margin())

    def due(self, step: int) -> bool:
        """Whether the cadence asks for a save at ``step``."""
        return self.cadence.due(step - (self.saved_step or 0), time.monotonic() - self.saved_at)

    def decide(
        self, step: int, agree: Agree | None, *, on_cadence: bool, failed: bool = False
    ) -> Decision:
        """At the step boundary after ``step`` steps: whether to save, and whether to stop,
        agreed over the job (``agree``; ``None`` with one process). A save request is
        answered here. With ``on_cadence`` this process's cadence counts (the leading
        process's, whose clock measures the saves); ``failed``: a background save failed."""
        reason = self.why_stop(step)
        flags = self.agree(
            BoundaryFlags(
                stop=bool(reason),
                signum=self.signum or 0,
                save=self.take_save_request(),
                due=on_cadence and self.due(step),
                failed=failed,
            ),
            agree,
        )
        return Decision(
            stop=self.reason_of(flags, reason) if flags.stop else "",
            signum=flags.signum,
            save=flags.save or flags.due,
            failed=flags.failed,
        )

    def agree(self, flags: BoundaryFlags, agree: Agree | None) -> BoundaryFlags:
        """``flags`` agreed over the job; a signal another process received becomes this
        one's, and a stop this one did not ask for gets its reason."""
        agreed = flags.agreed(agree)
        if agreed.signum and self.signum is None:
            self.signum = agreed.signum  # every process ends the way the signalled one does
        return agreed

    @staticmethod
    def reason_of(agreed: BoundaryFlags, own: str) -> str:
        """The stop's reason: this process's own, or what another process of the job saw."""
        if own:
            return own
        if agreed.signum:
            return f"another process of the job received {signal.Signals(agreed.signum).name}"
        return "another process of the job is stopping"

    def stopped(self, step: int, reason: str) -> None:
        """The loop saved ``step`` and stops for ``reason``: report it."""
        self.stop_reason = reason
        self.events.emit(ev.STOPPING, step, reason=reason)
        log.warning("nbresume: %s; saved step %d and stopped", reason, step)

    def end_for_signal(self, signum: int, step: int, *, leads: bool) -> None:
        """After the stop-save on the signal ``signum``, end the process as the signal would
        have: ``KeyboardInterrupt`` for an interrupt, else the after-stop action (once, by the
        leading process) and ``SystemExit(128 + signum)``."""
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if leads and self.after_stop is not None:
            self.after_stop(signum, step)  # one action (a requeue) for the whole job
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Put back the signal handlers and stop following uploads."""
        self.restore_signals()
        if self.durability is not None:
            self.durability.close()


class ControlledLoop:
    """What a loop with a :class:`LoopControl` (the Checkpointer's, a framework's watch)
    shows of it as its own: the events, the cadence, the deadline, the requests."""

    control: LoopControl

    @property
    def events(self) -> ev.EventBus:
        """The bus every :class:`~nbresume.checkpoint.events.Event` of this loop goes through."""
        return self.control.events

    @property
    def cadence(self) -> Cadence:
        """When the loop saves (``every=``), and what saves and steps were measured to cost."""
        return self.control.cadence

    @property
    def durability(self) -> DurabilityWatcher | None:
        """Follows checkpoints on a write-back store (Drive) until the durable copy matches."""
        return self.control.durability

    @property
    def deadline(self) -> float | None:
        """When the session ends (a Unix time), or ``None``."""
        return self.control.deadline

    @deadline.setter
    def deadline(self, when: float | None) -> None:
        self.control.deadline = when

    @property
    def deadline_source(self) -> str:
        """What the deadline is called (``"Kaggle's 12 h cap"``, ``"deadline="``)."""
        return self.control.deadline_source

    @property
    def stop_at(self) -> float | None:
        """When the loop saves and stops for the deadline (a Unix time), with the margin as
        measured now; ``None`` without a deadline."""
        return self.control.stop_at

    @property
    def after_stop(self) -> Callable[[int, int], object] | None:
        """Called after a stop-save on a signal, before the exit (a Slurm job asks to be
        requeued): ``after_stop(signum, step)``, by the process that leads the job."""
        return self.control.after_stop

    @after_stop.setter
    def after_stop(self, action: Callable[[int, int], object] | None) -> None:
        self.control.after_stop = action

    def request_save(self) -> None:
        """Ask for a save at the next step boundary. Safe from any thread (a panel's button,
        a handler): the save itself always happens in the training loop."""
        self.control.request_save()

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the running loop to save at the next step boundary and end cleanly, as before a
        deadline (the run stays unfinished). Safe from any thread; a request made while no
        loop runs is dropped when the next loop starts."""
        self.control.request_stop(reason)


@runtime_checkable
class RunningLoop(Protocol):
    """What the notebook panel, the magics, the status line and ``nbresume status`` read of
    a training loop, whether a :class:`~nbresume.checkpoint.loop.Checkpointer` runs it or a
    framework does (:class:`~nbresume.frameworks.watch.Watch`)."""

    @property
    def store(self) -> CheckpointStore: ...
    @property
    def events(self) -> ev.EventBus: ...
    @property
    def step(self) -> int: ...
    @property
    def total(self) -> int | None: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def cadence(self) -> Cadence: ...
    @property
    def durability(self) -> DurabilityWatcher | None: ...
    @property
    def restored_step(self) -> int | None: ...
    @property
    def started(self) -> bool: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def deadline_source(self) -> str: ...
    @property
    def stop_at(self) -> float | None: ...

    def request_save(self) -> None: ...
    def request_stop(self, reason: str = ...) -> None: ...
    def save(self, step: int | None = None, *, block: bool = ...) -> CheckpointInfo | None: ...
    def wait(self, *, durable: bool = ..., timeout: float | None = ...) -> object: ...
    def latest(self) -> CheckpointInfo | None: ...


__all__ = [
    "Agree",
    "BoundaryFlags",
    "ControlledLoop",
    "Decision",
    "LoopControl",
    "RunningLoop",
]
